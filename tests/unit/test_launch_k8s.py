"""`launcher=k8s`: the manifests against the published Kubeflow CRD schemas, checks, kubectl, pod env.

The CRDs are vendored under tests/data/k8s (source, commit and licence in its README). Kubernetes
prunes unknown fields silently and `kubectl apply` rejects them (strict field validation), so the
schemas are closed here: an object that lists its properties accepts no others.
"""

from __future__ import annotations

import functools
import gzip
import os
import stat
from pathlib import Path
from typing import Any

import pytest
import yaml
from unit_support import checked, checked_run, disttrain_in_process, said

from disttrain.config.errors import ConfigError
from disttrain.launch import k8s
from disttrain.launch.kubeflow_env import kubeflow_node_env, node_overrides

jsonschema = pytest.importorskip("jsonschema", reason="pip install -e .[dev] (jsonschema validates the CRDs)")

CRDS = Path(__file__).resolve().parent.parent / "data" / "k8s"
K8S = ("launcher=k8s", "launcher.image=ghcr.io/lab/train:1.4", "nodes=2", "nproc_per_node=2")
FULL = (
    *K8S,
    "launcher.gpus_per_node=2",
    "launcher.cpu=8",
    "launcher.memory=64Gi",
    "launcher.pvc=runs",
    "launcher.namespace=ml",
    "launcher.service_account=trainer",
    "+launcher.env.NCCL_DEBUG=INFO",
    "launcher.volumes=[datasets:/data]",
)


@functools.cache
def crd_schema(name: str) -> dict[str, Any]:
    with gzip.open(CRDS / name, "rt", encoding="utf-8") as f:
        crd = next(d for d in yaml.safe_load_all(f) if d)
    return closed(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])


def closed(schema: Any) -> Any:
    """The schema with additionalProperties: false wherever properties are listed (strict fields)."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) for k, v in schema.items()}
    preserve = schema.get("x-kubernetes-preserve-unknown-fields")
    if "properties" in schema and "additionalProperties" not in schema and not preserve:
        out["additionalProperties"] = False
    return out


TRAINJOB = "trainer.kubeflow.org_trainjobs.yaml.gz"
PYTORCHJOB = "kubeflow.org_pytorchjobs.yaml.gz"


def documents(tmp_path: Path, *overrides: str) -> list[dict[str, Any]]:
    cfg = checked_run([*FULL, *overrides])
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    text = k8s.render(cfg, tmp_path, k8s.job_name(cfg, tmp_path, now=0))
    return [d for d in yaml.safe_load_all(text) if d]


def errors(schema: dict[str, Any], doc: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft7Validator(schema)
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def test_trainjob_validates_against_the_trainer_v2_crd(tmp_path: Path) -> None:
    config_map, job = documents(tmp_path)
    assert errors(crd_schema(TRAINJOB), job) == []
    assert (job["apiVersion"], job["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    trainer = job["spec"]["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (2, 2)
    assert trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == "2"
    assert {"name": "NCCL_DEBUG", "value": "INFO"} in trainer["env"]
    assert trainer["command"][:2] == ["disttrain", "train"]
    assert job["spec"]["runtimeRef"]["name"] == "torch-distributed"
    pod = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    spec = pod["template"]["spec"]["template"]["spec"]
    assert {"name": "run-dir", "persistentVolumeClaim": {"claimName": "runs"}} in spec["volumes"]
    assert spec["serviceAccountName"] == "trainer"
    assert (
        config_map["kind"] == "ConfigMap"
        and config_map["metadata"]["name"] == f"{job['metadata']['name']}-config"
    )
    frozen = yaml.safe_load(config_map["data"]["frozen.yaml"])
    assert frozen == yaml.safe_load((tmp_path / "config.yaml").read_text())


def test_pytorchjob_validates_against_the_training_operator_crd(tmp_path: Path) -> None:
    _, job = documents(tmp_path, "launcher.api=pytorchjob")
    assert errors(crd_schema(PYTORCHJOB), job) == []
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert (specs["Master"]["replicas"], specs["Worker"]["replicas"]) == (1, 1)
    assert job["spec"]["nprocPerNode"] == "2"
    (container,) = specs["Master"]["template"]["spec"]["containers"]
    assert container["name"] == "pytorch" and container["ports"][0]["name"] == "pytorchjob-port"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"


def test_the_strict_schema_catches_a_misspelt_field_and_a_wrong_type(tmp_path: Path) -> None:
    """The validation is not vacuous: a typo in a field name and a string count both fail."""
    _, job = documents(tmp_path)
    schema = crd_schema(TRAINJOB)
    job["spec"]["trainer"]["numNode"] = job["spec"]["trainer"].pop("numNodes")
    assert any("numNode" in e for e in errors(schema, job))
    job["spec"]["trainer"]["numNodes"] = "2"
    assert any("numNodes" in e for e in errors(schema, job))


def test_one_node_pytorchjob_has_only_a_master(tmp_path: Path) -> None:
    _, job = documents(tmp_path, "launcher.api=pytorchjob", "nodes=1")
    assert list(job["spec"]["pytorchReplicaSpecs"]) == ["Master"]
    assert errors(crd_schema(PYTORCHJOB), job) == []


def test_job_names_are_dns_labels_from_the_run_name(tmp_path: Path) -> None:
    cfg = checked_run([*K8S, "name=GPT_small.v2"])
    a, b = k8s.job_name(cfg, tmp_path / "0", now=0), k8s.job_name(cfg, tmp_path / "1", now=0)
    assert a.startswith("gpt-small-v2-19700101-000000-") and len(a) == len(b) == 33 and a != b


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (("launcher=k8s",), "launcher.image"),
        (("launcher.image=a b",), "launcher.image"),
        (("launcher.api=mpijob",), "launcher.api"),
        (("launcher.namespace=ML_team",), "launcher.namespace"),
        (("launcher.pvc=Runs_1",), "launcher.pvc"),
        (("launcher.gpus_per_node=-1",), "launcher.gpus_per_node"),
        (("launcher.gpus_per_node=1",), "nproc_per_node"),
        (("launcher.memory=lots",), "launcher.memory"),
        (("+launcher.env.PET_NNODES=3",), "launcher.env.PET_NNODES"),
        (("+launcher.env.MASTER_ADDR=x",), "launcher.env.MASTER_ADDR"),
        (("launcher.volumes=[data]",), "launcher.volumes"),
        (("launcher.volumes=[d:/runs]",), "launcher.volumes"),
        (("launcher.run_root=runs",), "launcher.run_root"),
        # reliability D22: `.`, `..`, `/` and `//` passed the collision checks as other strings
        (("launcher.volumes=[data:/etc/disttrain/.]",), "launcher.volumes"),
        (("launcher.volumes=[data://etc/disttrain]",), "launcher.volumes"),
        (("launcher.volumes=[data:/]",), "launcher.volumes"),
        (("launcher.volumes=[data:/data/../runs]",), "launcher.volumes"),
        (("launcher.volumes=[data:/data,more:/data/]",), "launcher.volumes"),
        (("launcher.run_root=/runs/../etc/disttrain",), "launcher.run_root"),
        (("launcher.run_root=/etc/disttrain/",), "launcher.run_root"),
        (("launcher.run_root=//",), "launcher.run_root"),
        (("name=my run",), "name"),
        (("name=9lives",), "name"),
        (("nodes=1:2",), "launcher.min_nodes"),
    ],
)
def test_bad_k8s_settings_name_the_key(overrides: tuple[str, ...], key: str) -> None:
    base = K8S if overrides != ("launcher=k8s",) else ("nodes=2",)
    with pytest.raises(ConfigError) as info:
        checked([*base, *overrides])
    assert info.value.key == key


def test_mount_paths_are_compared_normalised() -> None:
    from disttrain.launch.k8s_checks import CONFIG_MOUNT, mount_path

    assert CONFIG_MOUNT == k8s.CONFIG_MOUNT
    assert [mount_path(p) for p in ("/data/", "/data/./x", "//data", "/", "/a/../b", "data")] == [
        "/data", "/data/x", "/data", None, None, None,
    ]  # fmt: skip
    checked([*K8S, "launcher.volumes=[a:/data/,b:/data/b]", "launcher.run_root=/runs/"])  # no collision


def test_dry_run_prints_the_manifest_and_applies_nothing(tmp_path: Path) -> None:
    proc = disttrain_in_process(
        "train", *K8S, "launcher.dry_run=true", "data=synthetic", "hydra.run.dir=r", cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert "kind: TrainJob" in proc.stdout and "dry run: not applied" in proc.stdout
    written = (tmp_path / "r" / "k8s" / "job.yaml").read_text()
    assert written in proc.stdout
    assert not (tmp_path / "r" / "logs").exists()


def test_missing_kubectl_is_one_paragraph_and_nothing_is_written(tmp_path: Path) -> None:
    proc = disttrain_in_process(
        "train", *K8S, "launcher.kubectl=/no/such/kubectl", "hydra.run.dir=r", cwd=tmp_path
    )
    assert proc.returncode == 2
    assert said(proc.stderr)[0].startswith(
        "disttrain: config error: launcher.kubectl=/no/such/kubectl is not valid"
    )
    assert "launcher.dry_run=true" in proc.stderr and "Traceback" not in proc.stderr
    assert len(said(proc.stderr)) == 1 and not (tmp_path / "r").exists()


def test_kubectl_applies_the_manifest_with_an_argv_list(tmp_path: Path) -> None:
    fake = tmp_path / "kubectl"
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$(dirname "$0")/argv.txt"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    proc = disttrain_in_process("train", *K8S, f"launcher.kubectl={fake}", "hydra.run.dir=r", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    manifest = tmp_path / "r" / "k8s" / "job.yaml"
    assert (tmp_path / "argv.txt").read_text().splitlines() == ["apply", "-f", str(manifest)]
    assert "submitted: TrainJob" in proc.stdout


# ----------------------------------------------------------------------------- the pods' environment
TRAINJOB_POD = {  # what Trainer v2's torch plugin sets (numNodes 2, numProcPerNode 2, pod index 1)
    "PET_NNODES": "2",
    "PET_NPROC_PER_NODE": "2",
    "PET_NODE_RANK": "1",
    "PET_MASTER_ADDR": "job-node-0-0.job",
    "PET_MASTER_PORT": "29500",
}
PYTORCHJOB_POD = {  # what the v1 operator sets on Worker 0 (RANK is the pod's node rank)
    "MASTER_ADDR": "job-master-0",
    "PET_MASTER_ADDR": "job-master-0",
    "MASTER_PORT": "29500",
    "PET_MASTER_PORT": "29500",
    "WORLD_SIZE": "4",
    "RANK": "1",
    "PET_NODE_RANK": "1",
    "PET_NPROC_PER_NODE": "2",
    "PET_NNODES": "2",
}


@pytest.mark.parametrize("environ", [TRAINJOB_POD, PYTORCHJOB_POD], ids=["trainjob", "pytorchjob"])
def test_operator_variables_become_node_settings(environ: dict[str, str]) -> None:
    node = kubeflow_node_env(environ)
    assert node is not None
    assert (node["nodes"], node["node_rank"], node["nproc_per_node"], node["master_port"]) == (2, 1, 2, 29500)
    assert node_overrides(["optim.lr=0.1", "master_port=1234"], environ) == [
        "optim.lr=0.1",
        "master_port=1234",
        "nodes=2",  # the job's shape comes from the operator, as torchrun takes it
        "node_rank=1",
        "nproc_per_node=2",
        f"master_addr={environ['PET_MASTER_ADDR']}",
    ]


def test_no_mapping_outside_a_pod_or_inside_a_torchrun_rank() -> None:
    assert kubeflow_node_env({}) is None
    assert kubeflow_node_env({**TRAINJOB_POD, "TORCHELASTIC_RUN_ID": "x", "RANK": "3"}) is None
    assert node_overrides(["a=1"], {}) == ["a=1"]


def test_a_pod_with_another_node_count_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in {**TRAINJOB_POD, "PET_NNODES": "3"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    with pytest.raises(ConfigError, match="PET_NNODES"):
        k8s.check_pod(checked_run(list(K8S)))
    assert os.environ["PET_NNODES"] == "3"


def test_kubectl_is_needed_to_submit_but_not_inside_a_pod(monkeypatch: pytest.MonkeyPatch) -> None:
    """The frozen config says dry_run=false; a pod has no kubectl and must train, not submit."""
    from disttrain.launch import k8s_checks

    cfg = checked_run([*K8S, "launcher.kubectl=/no/such/kubectl"])
    for k in TRAINJOB_POD:
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(ConfigError):
        k8s_checks.check_runtime(cfg)
    for k, v in TRAINJOB_POD.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    k8s_checks.check_runtime(cfg)
    assert k8s.in_pod()


def test_a_pod_composes_the_mounted_frozen_config_unchanged(tmp_path: Path) -> None:
    """`--config-dir /etc/disttrain --config-name frozen`: the ConfigMap's file is the primary config;
    only the node settings taken from the operator differ from the config frozen at submission."""
    (config_map, _) = documents(tmp_path)
    mounted = tmp_path / "etc-disttrain"
    mounted.mkdir()
    (mounted / "frozen.yaml").write_text(config_map["data"]["frozen.yaml"])
    node = ["node_rank=1", "master_addr=job-node-0-0.job", "master_port=29500"]
    cfg = checked([*node, "hydra/job_logging=none"], config_dir=str(mounted), config_name="frozen")
    frozen = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert {k: v for k, v in cfg.items() if k not in ("node_rank", "master_addr", "master_port")} == {
        k: v for k, v in frozen.items() if k not in ("node_rank", "master_addr", "master_port")
    }
    assert (cfg["node_rank"], cfg["master_addr"], cfg["master_port"]) == (1, "job-node-0-0.job", 29500)
