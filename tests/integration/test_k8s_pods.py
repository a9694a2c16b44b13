"""The pods of a `launcher=k8s` job, simulated: two network namespaces play the job's two pods.

`disttrain train launcher=k8s launcher.dry_run=true` writes the manifest; each "pod" then runs the
container's command from it, with
  * the container's env from the manifest plus what the operator injects (Trainer v2's torch
    plugin: PET_NNODES/NPROC_PER_NODE/NODE_RANK/MASTER_ADDR/MASTER_PORT; the v1 PyTorchJob
    controller: MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK and the PET_* ones), see
    disttrain/launch/kubeflow_env.py for the sources;
  * the volumes as the container runtime mounts them: the ConfigMap's frozen.yaml in a folder per
    pod, the run-dir PVC as one folder both pods share (a ReadWriteMany claim); mount paths in the
    command are replaced by those folders;
  * the master's DNS name (`<job>-node-0-0.<job>`, `<job>-master-0`) resolving to node 0's address
    through the namespace's own /etc/hosts (`ip netns exec` mounts /etc/netns/NS/hosts).
The losses must equal a one-node run with the same world size (the session's baseline).
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from .conftest import BASELINE, CLI, FAST, clean_env, run_command, train_losses
from .netns import MASTER, assert_like_one_node, report, run_all

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

TIMEOUT = 200.0


def operator_env(job: dict[str, Any], node_rank: int) -> tuple[str, dict[str, str]]:
    """(master host name, variables) that the operator gives pod `node_rank` of `job`."""
    name = job["metadata"]["name"]
    if job["kind"] == "TrainJob":  # kubeflow/trainer pkg/runtime/framework/plugins/torch/torch.go
        trainer = job["spec"]["trainer"]
        master = f"{name}-node-0-0.{name}"
        return master, {
            "PET_NNODES": str(trainer["numNodes"]),
            "PET_NPROC_PER_NODE": str(trainer["numProcPerNode"]),
            "PET_NODE_RANK": str(node_rank),
            "PET_MASTER_ADDR": master,
            "PET_MASTER_PORT": "29500",
        }
    specs = job["spec"]["pytorchReplicaSpecs"]  # training-operator pkg/controller.v1/pytorch/envvar.go
    replicas = sum(s["replicas"] for s in specs.values())
    port = str(specs["Master"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"])
    master = f"{name}-master-0"
    return master, {
        "PYTHONUNBUFFERED": "1",
        "MASTER_PORT": port,
        "PET_MASTER_PORT": port,
        "MASTER_ADDR": master,
        "PET_MASTER_ADDR": master,
        "WORLD_SIZE": str(replicas * int(job["spec"]["nprocPerNode"])),
        "RANK": str(node_rank),
        "PET_NODE_RANK": str(node_rank),
        "PET_NPROC_PER_NODE": job["spec"]["nprocPerNode"],
        "PET_NNODES": str(replicas),
    }


def pod_spec(job: dict[str, Any]) -> dict[str, Any]:
    """The container (image, command, env, mounts) and volumes every pod of the job gets."""
    if job["kind"] == "TrainJob":
        patch = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]
        spec = patch["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
        container = {**job["spec"]["trainer"], **spec["containers"][0]}
        return {"container": container, "volumes": spec["volumes"]}
    spec = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    return {"container": spec["containers"][0], "volumes": spec["volumes"]}


def mount(pod: dict[str, Any], config_map: dict[str, Any], root: Path, shared: Path) -> dict[str, Path]:
    """mountPath -> host folder: the ConfigMap per pod, every PVC shared (ReadWriteMany)."""
    volumes = {v["name"]: v for v in pod["volumes"]}
    paths = {}
    for m in pod["container"]["volumeMounts"]:
        volume = volumes[m["name"]]
        if "configMap" in volume:
            assert volume["configMap"]["name"] == config_map["metadata"]["name"]
            folder = root / m["name"]
            folder.mkdir(parents=True)
            for key, text in config_map["data"].items():
                (folder / key).write_text(text)
        else:
            folder = shared / volume["persistentVolumeClaim"]["claimName"]
            folder.mkdir(parents=True, exist_ok=True)
        paths[m["mountPath"]] = folder
    return paths


def in_host_paths(arg: str, paths: dict[str, Path]) -> str:
    for pod_path, host in sorted(paths.items(), key=lambda kv: -len(kv[0])):
        if pod_path in arg:
            return arg.replace(pod_path, str(host))
    return arg


@contextlib.contextmanager
def hosts_file(namespaces: list[str], name: str) -> Any:
    """`name` resolves to node 0's address in every namespace (the job's headless Service)."""
    made = []
    try:
        for ns in namespaces:
            folder = Path("/etc/netns") / ns
            folder.mkdir(parents=True)
            made.append(folder)
            (folder / "hosts").write_text(f"127.0.0.1 localhost\n{MASTER} {name}\n")
        yield
    finally:
        for folder in made:
            shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("api", ["trainjob", "pytorchjob"])
def test_the_jobs_pods_train_like_one_node(
    tmp_path: Path,
    netns_pair: tuple[tuple[str, str], tuple[str, str]],
    api: str,
    baseline: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    (ns0, veth0), (ns1, veth1) = netns_pair
    submit = run_command(
        [CLI, "train", *FAST, *BASELINE, "launcher=k8s", f"launcher.api={api}", "launcher.image=disttrain:test",
         "launcher.pvc=runs", "launcher.dry_run=true", "nodes=2", "nproc_per_node=1", "hydra.run.dir=submit"],
        tmp_path,
    )  # fmt: skip
    assert submit.returncode == 0, submit.stderr
    config_map, job = [d for d in yaml.safe_load_all((tmp_path / "submit/k8s/job.yaml").read_text()) if d]
    pod = pod_spec(job)
    master, _ = operator_env(job, 0)
    with hosts_file([ns0, ns1], master):
        pods: list[tuple[list[str], Path, dict[str, str]]] = []
        for rank, (ns, veth) in enumerate(((ns0, veth0), (ns1, veth1))):
            root = tmp_path / f"pod{rank}"
            paths = mount(pod, config_map, root, tmp_path / "pvc")
            workdir = root / "work"
            workdir.mkdir()
            command = [in_host_paths(a, paths) for a in pod["container"]["command"]]
            assert command[:2] == ["disttrain", "train"]
            _, injected = operator_env(job, rank)
            env = clean_env(GLOO_SOCKET_IFNAME=veth)
            env.update({e["name"]: e["value"] for e in pod["container"]["env"]})
            env.update(injected)
            pods.append((["ip", "netns", "exec", ns, CLI, *command[1:]], workdir, env))
        results = run_all(pods, TIMEOUT, what="pod")
    assert all(r.returncode == 0 for r in results), report(results)
    run_dir = tmp_path / "pvc" / "runs" / job["metadata"]["name"]
    assert sorted(p.name for p in (run_dir / "logs").glob("rank*.log")) == ["rank0.log", "rank1.log"]
    assert (run_dir / "rendezvous_node1.json").is_file()
    assert_like_one_node(train_losses(run_dir), train_losses(baseline[1]))  # the baseline's config, one node
