"""k8s (a Kubeflow TrainJob or PyTorchJob applied with kubectl): its config and spec. Inside a pod
(the operator's PET_* variables, or any Kubernetes pod) the spec is detected; a pod whose operator
names its node (PET_NNODES, PET_NODE_RANK: `disttrain.launch.kubeflow_env`) is a node's launcher,
even where PyTorchJob sets RANK (the node's rank there)."""

from __future__ import annotations

from dataclasses import dataclass

from disttrain.config.common import help_field as _h
from disttrain.config.schema import LauncherConfig
from disttrain.launch.specs import LAUNCHERS, Environ, LauncherSpec


@dataclass
class K8sLauncherConfig(LauncherConfig):
    """A Kubeflow TrainJob (or PyTorchJob) manifest in the run dir; kubectl applies it."""

    name: str = "k8s"
    image: str | None = _h("container image with disttrain and your code installed (required)", None)
    namespace: str = _h("Kubernetes namespace of the job and its ConfigMap", "default")
    api: str = _h(
        "trainjob (Kubeflow Trainer v2) or pytorchjob (the legacy v1 training-operator)", "trainjob"
    )
    runtime: str = _h("trainjob: the ClusterTrainingRuntime to run on", "torch-distributed")
    gpus_per_node: int = _h("nvidia.com/gpu per pod (one rank per GPU); 0: none requested", 0)
    cpu: str | None = _h("CPU request and limit per pod, e.g. 8 or 7500m; null: the cluster's default", None)
    memory: str | None = _h("memory request and limit per pod, e.g. 64Gi; null: the cluster's default", None)
    env: dict[str, str] = _h(
        "extra environment variables of every pod: +launcher.env.NCCL_DEBUG=INFO", factory=dict
    )
    pvc: str | None = _h(
        "PersistentVolumeClaim (ReadWriteMany) for the run dir; null: a per-pod emptyDir", None
    )
    run_root: str = _h("where the run dir volume is mounted; the run dir is RUN_ROOT/JOB_NAME", "/runs")
    volumes: list[str] = _h("more PVCs to mount as CLAIM:MOUNT_PATH, e.g. [datasets:/data]", factory=list)
    service_account: str | None = _h("serviceAccountName of the pods (e.g. for object-store access)", None)
    kubectl: str = _h("the kubectl program that applies the manifest", "kubectl")
    dry_run: bool = _h("print the manifest (and write it to the run dir) without applying it", False)


def detect(environ: Environ) -> bool:
    return any(k.startswith("PET_") for k in environ) or "KUBERNETES_SERVICE_HOST" in environ


SPEC = LAUNCHERS.register(
    LauncherSpec(
        "k8s",
        K8sLauncherConfig,
        "disttrain.launch.k8s:K8sLauncher",
        "k8s: applies a Kubeflow TrainJob",
        detect=detect,
        node_overrides="disttrain.launch.kubeflow_env:pod_node_overrides",  # a Kubeflow pod's node settings
        started_by="kubeflow",
        own_files=True,
    )
)
