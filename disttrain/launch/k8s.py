"""`launcher=k8s`: a Kubeflow TrainJob (or legacy PyTorchJob) manifest in the run dir; kubectl applies it.

The manifest holds two objects: a ConfigMap with the run's frozen config.yaml, and the job. Every
pod mounts the ConfigMap and runs `disttrain train --config-dir /etc/disttrain --config-name frozen`:
the same resolved config on every node (nothing re-composed from the image's own config files, no
`${now:}` resolved per pod). In the pod, disttrain reads the operator's PET_* variables
(`kubeflow_env`) as node_rank/master_addr/master_port and starts `nproc_per_node` ranks like a
by-hand node: the nodes' roll call compares config hashes, then torchrun's c10d rendezvous runs.
The run dir is `<run_root>/<job>` on `launcher.pvc` (shared by the pods), or on a per-pod emptyDir:
then a multi-node job keeps its checkpoints in an object store (checkpoint.dir=s3://... or gs://...),
which needs no ReadWriteMany volume.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import yaml

from disttrain.config.errors import ConfigError
from disttrain.launch import k8s_checks
from disttrain.launch.base import Launcher
from disttrain.launch.k8s_checks import k8s_name
from disttrain.launch.specs.k8s import K8sLauncherConfig
from disttrain.rundir import RunDir
from disttrain.safefile import write_text_atomic
from disttrain.storage import is_url

if TYPE_CHECKING:
    from disttrain.config.run import Run

MANIFEST = "k8s/job.yaml"
CONFIG_MOUNT = "/etc/disttrain"  # the ConfigMap's mount point in every pod
CONFIG_NAME = "frozen"  # its key: frozen.yaml, the run's config.yaml
TRAINER_PORT = 29500  # Trainer v2's torch runtime serves PET_MASTER_PORT here; the PyTorchJob port too
JOB_NAME_MAX = 52  # `<job>-worker-<i>` / `<job>-node-0-<i>` must stay a 63-character DNS label
STAMP = "%Y%m%d-%H%M%S"
API = {
    "trainjob": ("trainer.kubeflow.org/v1alpha1", "TrainJob"),
    "pytorchjob": ("kubeflow.org/v1", "PyTorchJob"),
}


class K8sLauncher(Launcher):
    """kubectl applies a Kubeflow job; in each of its pods `disttrain train` starts the node's ranks."""

    scheduler = True
    sweeps = True

    def check_static(self, run: Run) -> None:
        k8s_checks.check_static(run)

    def check_runtime(self, run: Run) -> None:
        k8s_checks.check_runtime(run)

    def submit(self, run: Run, run_dir: Path, command: list[str]) -> bool:
        if in_pod():  # a pod of the job: train here, as one node
            check_pod(run)
            return False
        submit(run, run_dir)  # the job's pods train, each into its own <run_root>/<job>
        return True

    def submit_sweep(
        self,
        jobs: Sequence[tuple[int, Run, Path]],
        sweep_dir: Path,
        max_parallel: int,
        submitted: Callable[[int, str], None],
    ) -> None:
        submit_jobs(jobs, max_parallel, submitted)  # one Job per sweep point, at most max_parallel alive

    def sweep_states(self, ids: Mapping[int, str], timeout: float) -> dict[int, tuple[str, str]]:
        return job_states(ids, "kubectl", timeout)  # kubectl from PATH: the record names no program

    def launch(self, run: Run, run_dir: Path, entry: str) -> None:
        from disttrain.launch.torchrun import launch_torchrun

        launch_torchrun(run, run_dir, entry)


def job_name(run: Run, run_dir: Path, now: float | None = None) -> str:
    """`<name>-YYYYMMDD-HHMMSS-<4 hex of the run dir>` (UTC): a DNS-1035 label, unique per sweep job.

    `name` is lower-cased with _ and . as -; the run dir's hash tells apart the jobs of one `-m`
    sweep submitted within the same second.
    """
    stamp = time.strftime(STAMP, time.gmtime(time.time() if now is None else now))
    tag = hashlib.sha256(str(run_dir).encode()).hexdigest()[:4]
    name = f"{k8s_name(run.name)}-{stamp}-{tag}"
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= JOB_NAME_MAX, name
    return name


def pod_command(run: Run, job: str) -> list[str]:
    """What every pod runs: train the mounted frozen config into the run dir `<run_root>/<job>`."""
    run_dir = f"{cast(K8sLauncherConfig, run.launcher).run_root.rstrip('/')}/{job}"
    return [
        "disttrain",
        "train",
        "--config-dir",
        CONFIG_MOUNT,
        "--config-name",
        CONFIG_NAME,
        f"hydra.run.dir={run_dir}",
        "hydra/job_logging=none",  # as disttrain's own config.yaml: disttrain logs, not Hydra
    ]


def manifests(run: Run, frozen: str, job: str) -> list[dict[str, Any]]:
    """[ConfigMap with the frozen config, TrainJob or PyTorchJob]."""
    lc = cast(K8sLauncherConfig, run.launcher)
    meta = {
        "name": job,
        "namespace": lc.namespace,
        "labels": {"app.kubernetes.io/managed-by": "disttrain"},
    }
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {**meta, "name": f"{job}-config"},
        "data": {f"{CONFIG_NAME}.yaml": frozen},
    }
    build = trainjob if lc.api == "trainjob" else pytorchjob
    return [config_map, build(run, job, meta)]


def trainjob(run: Run, job: str, meta: dict[str, Any]) -> dict[str, Any]:
    """Trainer v2: the runtime's `node` job; volumes and the service account as a runtime patch."""
    lc = cast(K8sLauncherConfig, run.launcher)
    pod: dict[str, Any] = {
        "volumes": volumes(run, job),
        "containers": [{"name": "node", "volumeMounts": mounts(run)}],
    }
    if lc.service_account:
        pod["serviceAccountName"] = lc.service_account
    patch = {"replicatedJobs": [{"name": "node", "template": {"spec": {"template": {"spec": pod}}}}]}
    return {
        "apiVersion": API["trainjob"][0],
        "kind": "TrainJob",
        "metadata": meta,
        "spec": {
            "runtimeRef": {
                "apiGroup": "trainer.kubeflow.org",
                "kind": "ClusterTrainingRuntime",
                "name": lc.runtime,
            },
            "trainer": {
                "image": lc.image,
                "command": pod_command(run, job),
                "numNodes": run.world.nodes,
                "numProcPerNode": run.world.nproc_per_node,
                "resourcesPerNode": resources(run),
                "env": env(run),
            },
            "runtimePatches": [
                {"manager": "disttrain", "trainingRuntimeSpec": {"template": {"spec": patch}}}
            ],
        },
    }


def pytorchjob(run: Run, job: str, meta: dict[str, Any]) -> dict[str, Any]:
    """The v1 training-operator's PyTorchJob: one Master pod (node 0) and nodes-1 Worker pods."""
    lc = cast(K8sLauncherConfig, run.launcher)
    container = {
        "name": "pytorch",  # the operator finds the master port on this container
        "image": lc.image,
        "command": pod_command(run, job),
        "env": env(run),
        "resources": resources(run),
        "volumeMounts": mounts(run),
        "ports": [{"name": "pytorchjob-port", "containerPort": TRAINER_PORT}],
    }
    pod: dict[str, Any] = {"volumes": volumes(run, job), "containers": [container]}
    if lc.service_account:
        pod["serviceAccountName"] = lc.service_account

    def replica(n: int) -> dict[str, Any]:
        # Never: a restarted pod would join a rendezvous the others have left; rerun the job instead.
        return {"replicas": n, "restartPolicy": "Never", "template": {"spec": pod}}

    specs = {"Master": replica(1)}
    if run.world.nodes > 1:
        specs["Worker"] = replica(run.world.nodes - 1)
    return {
        "apiVersion": API["pytorchjob"][0],
        "kind": "PyTorchJob",
        "metadata": meta,
        "spec": {"nprocPerNode": str(run.world.nproc_per_node), "pytorchReplicaSpecs": specs},
    }


def resources(run: Run) -> dict[str, Any]:
    lc = cast(K8sLauncherConfig, run.launcher)
    sized = {k: str(v) for k, v in (("cpu", lc.cpu), ("memory", lc.memory)) if v is not None}
    limits = dict(sized)
    if lc.gpus_per_node:
        limits["nvidia.com/gpu"] = str(lc.gpus_per_node)
    return {k: v for k, v in (("limits", limits), ("requests", sized)) if v}


def env(run: Run) -> list[dict[str, str]]:
    values = {
        "PYTHONUNBUFFERED": "1",
        **{str(k): str(v) for k, v in cast(K8sLauncherConfig, run.launcher).env.items()},
    }
    return [{"name": k, "value": v} for k, v in values.items()]


def volumes(run: Run, job: str) -> list[dict[str, Any]]:
    lc = cast(K8sLauncherConfig, run.launcher)
    run_dir: dict[str, Any] = {"persistentVolumeClaim": {"claimName": lc.pvc}} if lc.pvc else {"emptyDir": {}}
    out = [
        {"name": "disttrain-config", "configMap": {"name": f"{job}-config"}},
        {"name": "run-dir", **run_dir},
    ]
    out += [
        {"name": f"volume-{i}", "persistentVolumeClaim": {"claimName": v.split(":", 1)[0]}}
        for i, v in enumerate(lc.volumes)
    ]
    return out


def mounts(run: Run) -> list[dict[str, Any]]:
    lc = cast(K8sLauncherConfig, run.launcher)
    out: list[dict[str, Any]] = [
        {"name": "disttrain-config", "mountPath": CONFIG_MOUNT, "readOnly": True},
        {"name": "run-dir", "mountPath": lc.run_root},
    ]
    out += [{"name": f"volume-{i}", "mountPath": v.split(":", 1)[1]} for i, v in enumerate(lc.volumes)]
    return out


def render(run: Run, run_dir: Path, job: str) -> str:
    """The manifest file: a comment head (how to apply, follow, delete), then the YAML documents."""
    lc = cast(K8sLauncherConfig, run.launcher)
    kind = API[lc.api][1]
    path, ns = run_dir / MANIFEST, lc.namespace
    head = [
        f"# Written by disttrain for run {run_dir}",
        f"# Apply by hand: kubectl apply -f {shlex.quote(str(path))}",
        f"# Follow: kubectl -n {ns} get {kind.lower()} {job}; kubectl -n {ns} logs -f {job}-"
        + ("node-0-0-<suffix>" if lc.api == "trainjob" else "master-0"),
        f"# Delete: kubectl -n {ns} delete {kind.lower()},configmap {job} {job}-config",
    ]
    if not lc.pvc:
        head.append(
            "# Run dir: an emptyDir per pod (lost with the pod); set launcher.pvc=CLAIM for a shared, kept one"
        )
        if is_url(run.checkpoint.dir):
            head.append(
                f"# Checkpoints: {run.checkpoint.dir}, an object store every pod reaches (no shared volume)"
            )
        elif run.world.nodes > 1:
            head.append(
                "# Several pods and no shared claim: set checkpoint.dir=s3://BUCKET/RUN (or gs://, or a path on "
                "a claim in launcher.volumes), else the ranks stop before training (no place every pod sees)"
            )
    docs = manifests(run, RunDir(run_dir).config.read_text(), job)
    body = yaml.dump_all(docs, Dumper=_BlockDumper, sort_keys=False)
    return "\n".join(head) + "\n---\n" + body


class _BlockDumper(yaml.SafeDumper):
    """yaml.safe_dump, with multi-line strings (the ConfigMap's config.yaml) as readable | blocks."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_BlockDumper.add_representer(str, _str)


def submit(run: Run, run_dir: Path, job: str | None = None) -> str:
    """Write the manifest into the run dir; `kubectl apply` it unless dry_run. Returns the job name.
    `job`: that name again (a sweep's resumed job: its pods' run dir `<run_root>/<job>` holds its
    checkpoints), after the old job and its ConfigMap are deleted."""
    lc = cast(K8sLauncherConfig, run.launcher)
    again, job = job is not None, job or job_name(run, run_dir)
    text = render(run, run_dir, job)
    path = run_dir / MANIFEST
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, text)  # a run dir is reused on resume: never through a planted link
    write_text_atomic(run_dir / "k8s" / "job_name", job + "\n")
    if lc.dry_run:
        sys.stdout.write(text)
        sys.stdout.write(f"# dry run: not applied. Manifest: {path}\n# apply it: kubectl apply -f {path}\n")
        return job
    kind, ns = API[lc.api][1], lc.namespace
    if again:
        _kubectl(
            lc, ["-n", ns, "delete", f"{kind.lower()},configmap", job, f"{job}-config", "--ignore-not-found"]
        )
    _kubectl(lc, ["apply", "-f", str(path)], f"; the manifest is {path}")
    sys.stdout.write(
        f"submitted: {kind} {job} in namespace {ns}\n  run dir: {run_dir} (manifest {path})\n"
        f"  state:   kubectl -n {ns} get {kind.lower()} {job}\n"
    )
    return job


def _kubectl(lc: K8sLauncherConfig, args: list[str], where: str = "") -> str:
    """`kubectl ARGS` (an argv list: nothing reaches a shell); its stdout, or the ConfigError."""
    argv = [lc.kubectl, *args]
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        detail = (getattr(exc, "stderr", "") or str(exc)).strip()
        raise ConfigError(
            "launcher",
            "k8s",
            "a kubectl that reaches the cluster",
            f"`{shlex.join(argv)}` failed: {detail}{where}.",
        ) from None


# ------------------------------------------------------------------------------- a sweep's Jobs
POLL_S = 15.0  # seconds between two looks at a capped sweep's live Jobs
ENDED = ("finished", "failed", "cancelled")


def sweep_id(run: Run, job: str) -> str:
    """A sweep job's id in sweep.json: `<kind>.<namespace>.<name>` (DNS labels: no dots of their own)."""
    lc = cast(K8sLauncherConfig, run.launcher)
    return f"{API[lc.api][1].lower()}.{lc.namespace}.{job}"


def submit_jobs(
    jobs: Sequence[tuple[int, Run, Path]], max_parallel: int, submitted: Callable[[int, str], None]
) -> None:
    """Apply one Job per sweep point. With a cap, at most `max_parallel` are alive at once: the rest
    are applied here as live ones end (Kubernetes has no queue of its own for them), and this
    command returns once the last one is applied. A job submitted again (`sweep resume`) keeps its
    name, so its pods continue in their run dir `<run_root>/<job>`."""
    waiting, live = list(jobs), dict[int, str]()
    lc = cast(K8sLauncherConfig, jobs[0][1].launcher)
    while waiting:
        while waiting and (not max_parallel or len(live) < max_parallel):
            num, run, run_dir = waiting.pop(0)
            previous = run_dir / "k8s" / "job_name"
            name = previous.read_text().strip() if previous.is_file() else ""
            job = submit(run, run_dir, name if _DNS.fullmatch(name) else None)
            live[num] = sweep_id(run, job)
            if not lc.dry_run:  # a printed manifest is no job of the cluster's
                submitted(num, live[num])
        if not waiting or lc.dry_run:
            break
        sys.stderr.write(
            f"disttrain: {len(live)} jobs alive (sweep.max_parallel={max_parallel}), {len(waiting)} waiting\n"
        )
        time.sleep(POLL_S)
        for num, (state, _) in job_states(live, lc.kubectl, 60.0).items():
            if state in ENDED:
                del live[num]


def _condition(item: Any) -> tuple[str, str]:
    """(name, last true condition among CONDITIONS, else Created) of a job kubectl printed."""
    fields = {k: item.get(k) if isinstance(item, dict) else None for k in ("metadata", "status")}
    meta, status = (v if isinstance(v, dict) else {} for v in fields.values())
    conditions = status.get("conditions")
    true = [
        c.get("type")
        for c in (conditions if isinstance(conditions, list) else [])
        if isinstance(c, dict) and c.get("status") == "True"
    ]
    return str(meta.get("name")), next((t for t in reversed(true) if t in CONDITIONS), "Created")


_DNS = re.compile(r"[a-z]([-a-z0-9]{0,50}[a-z0-9])?")
# A job's conditions (TrainJob: Complete, Failed, Suspended; PyTorchJob: Created, Running,
# Restarting, Succeeded, Failed) in disttrain.sweepdir.STATES; the last true one speaks.
CONDITIONS = {
    "Complete": "finished",
    "Succeeded": "finished",
    "Failed": "failed",
    "Suspended": "pending",
    "Created": "pending",
    "Running": "running",
    "Restarting": "running",
}


def job_states(ids: Mapping[int, str], kubectl: str, timeout: float) -> dict[int, tuple[str, str]]:
    """What the cluster says of each sweep job (`<kind>.<namespace>.<name>`): its last true
    condition; a job kubectl no longer finds was deleted (cancelled). Nothing where kubectl fails."""
    by_place: dict[tuple[str, str], dict[str, int]] = {}
    for num, sid in ids.items():
        kind, _, rest = sid.partition(".")
        ns, _, name = rest.partition(".")
        if kind in ("trainjob", "pytorchjob") and _DNS.fullmatch(ns) and _DNS.fullmatch(name):
            by_place.setdefault((kind, ns), {})[name] = num
    out: dict[int, tuple[str, str]] = {}
    for (kind, ns), names in by_place.items():
        argv = [kubectl, "-n", ns, "get", kind, *names, "-o", "json", "--ignore-not-found"]
        try:
            text = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=True).stdout
            data = json.loads(text) if text.strip() else {"items": []}
        except (OSError, subprocess.SubprocessError, ValueError):
            continue
        items = data.get("items", [data]) if isinstance(data, dict) else []
        seen = set()
        for item in items if isinstance(items, list) else []:
            name, word = _condition(item)
            if name in names:
                seen.add(name)
                out[names[name]] = (CONDITIONS[word], word)
        for name in set(names) - seen:
            out[names[name]] = ("cancelled", "deleted")
    return out


def in_pod() -> bool:
    """True in a pod of the job (the operator's variables are set): train here, do not submit."""
    from disttrain.launch.kubeflow_env import kubeflow_node_env

    return kubeflow_node_env() is not None


def check_pod(run: Run) -> None:
    """In a pod: the operator's node count and processes per node must be the config's."""
    from disttrain.launch.kubeflow_env import kubeflow_node_env

    node = kubeflow_node_env()
    if node is None:
        return
    for key in ("nodes", "nproc_per_node"):
        configured = getattr(run.world, key)
        if node[key] is not None and node[key] != configured:
            raise ConfigError(
                key,
                configured,
                f"{node[key]} (PET_{'NNODES' if key == 'nodes' else 'NPROC_PER_NODE'} set by the operator)",
                "the job's numNodes/numProcPerNode (replicas/nprocPerNode) must match the frozen config; "
                "submit again with launcher=k8s rather than editing the manifest.",
            )
