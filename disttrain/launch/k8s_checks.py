"""Checks of `launcher=k8s` before anything is written: names Kubernetes accepts, resources, kubectl.

No value reaches a shell (kubectl gets an argv list, the manifest is yaml.safe_dump), but a name the
API server would refuse is better refused here, with the key, than after a queue wait.
"""

from __future__ import annotations

import posixpath
import re
import shutil
from typing import TYPE_CHECKING, Any, cast

from disttrain.config.errors import ConfigError, one_of
from disttrain.launch.specs.k8s import K8sLauncherConfig

if TYPE_CHECKING:
    from disttrain.config.run import Run

DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")  # RFC 1123 label, at most 63 characters
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
QUANTITY = re.compile(r"\d+(\.\d+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?")
IMAGE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@-]*")
PATH = re.compile(r"/[A-Za-z0-9._/-]*")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Set by the operator or its runtime (the Trainer webhook rejects PET_* in trainer.env).
RESERVED_ENV = ("PET_", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK")
NAME_MAX = 31  # + "-YYYYMMDD-HHMMSS-abcd" = 52: pod names `<job>-worker-<i>` stay 63-character labels
APIS = ("trainjob", "pytorchjob")
CONFIG_MOUNT = "/etc/disttrain"  # where the pods read the frozen config (launch/k8s.py mounts it)


def k8s_name(name: str) -> str:
    """The run name as the start of a Kubernetes name: lower case, _ and . as -."""
    return re.sub(r"[_.]", "-", str(name).lower())


def check_static(run: Run) -> None:
    lc = cast(K8sLauncherConfig, run.launcher)
    if not lc.image or not IMAGE.fullmatch(str(lc.image)):
        raise ConfigError(
            "launcher.image",
            lc.image,
            "a container image reference with disttrain and your code installed",
            "e.g. launcher.image=ghcr.io/lab/train:1.4 (build it from your repo; every pod runs it).",
        )
    if lc.api not in APIS:
        raise ConfigError(
            "launcher.api",
            lc.api,
            one_of(APIS),
            "trainjob needs Kubeflow Trainer v2; pytorchjob the v1 operator.",
        )
    name = k8s_name(run.name)
    if len(name) > NAME_MAX or not re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name):
        raise ConfigError(
            "name",
            run.name,
            f"with launcher=k8s: up to {NAME_MAX} letters, digits, '-', '_' or '.', starting with a letter "
            "and ending with a letter or digit (the job is NAME-YYYYMMDD-HHMMSS-abcd, a DNS label)",
            "e.g. name=gpt-small.",
        )
    for key, pattern in (("namespace", DNS_LABEL), ("runtime", DNS_SUBDOMAIN)):
        _name(lc, key, pattern)
    for key in ("service_account", "pvc"):
        if getattr(lc, key) is not None:
            _name(lc, key, DNS_SUBDOMAIN)
    _resources(run)
    _env(lc.env)
    _volumes(lc)
    if lc.min_nodes:
        raise ConfigError(
            "launcher.min_nodes",
            lc.min_nodes,
            "0 with launcher=k8s (the job starts a fixed number of pods)",
            f"use nodes={run.world.nodes}.",
        )
    if not str(lc.kubectl).strip():
        raise ConfigError("launcher.kubectl", lc.kubectl, "a program name or path", "the default is kubectl.")


def _name(lc: K8sLauncherConfig, key: str, pattern: re.Pattern[str]) -> None:
    value = str(getattr(lc, key))
    if len(value) > (63 if pattern is DNS_LABEL else 253) or not pattern.fullmatch(value):
        raise ConfigError(
            f"launcher.{key}",
            getattr(lc, key),
            "a Kubernetes name: lowercase letters, digits and '-'"
            + ("" if pattern is DNS_LABEL else " or '.'"),
            f"`kubectl get {'namespaces' if key == 'namespace' else key.replace('_', '')}` lists them.",
        )


def _resources(run: Run) -> None:
    lc = cast(K8sLauncherConfig, run.launcher)
    gpus = lc.gpus_per_node
    if gpus is None or gpus < 0:
        raise ConfigError("launcher.gpus_per_node", gpus, "an integer >= 0", "0 requests no GPU.")
    if gpus and run.world.nproc_per_node > gpus:
        raise ConfigError(
            "nproc_per_node",
            run.world.nproc_per_node,
            f"<= launcher.gpus_per_node={gpus} (one rank per GPU)",
            f"set nproc_per_node={gpus}.",
        )
    for key in ("cpu", "memory"):
        if getattr(lc, key) is not None and not QUANTITY.fullmatch(str(getattr(lc, key))):
            raise ConfigError(
                f"launcher.{key}",
                getattr(lc, key),
                "a Kubernetes quantity, e.g. 8, 7500m, 64Gi",
                "null leaves it to the cluster.",
            )


def _env(values: dict[str, Any]) -> None:
    for name in values:
        reserved = any(name == r or (r.endswith("_") and name.startswith(r)) for r in RESERVED_ENV)
        if not ENV_NAME.fullmatch(str(name)) or reserved:
            raise ConfigError(
                f"launcher.env.{name}",
                values[name],
                "a variable name (letters, digits, _) that the operator does not set: not PET_*, MASTER_*, "
                "RANK, WORLD_SIZE",
                "the operator and disttrain set the rendezvous variables themselves.",
            )


def mount_path(text: str) -> str | None:
    """`text` as the pod sees it (`/data/.`, `/data/` and `//data` are `/data`), or None when it is
    not an absolute path of plain names, or is `/` or climbs with `..`: the collision checks below
    compare these normalised forms, so `data:/etc/disttrain/.` cannot slip past as another string."""
    if not PATH.fullmatch(text) or ".." in text.split("/"):
        return None
    path = "/" + posixpath.normpath(text).lstrip("/")
    return None if path == "/" else path


def _volumes(lc: K8sLauncherConfig) -> None:
    run_root = mount_path(str(lc.run_root))
    if run_root is None or run_root == CONFIG_MOUNT:
        raise ConfigError(
            "launcher.run_root",
            lc.run_root,
            f"an absolute path in the pod, without `..` (not / or {CONFIG_MOUNT})",
            "e.g. /runs.",
        )
    taken = {CONFIG_MOUNT, run_root}
    for volume in lc.volumes:
        claim, _, text = str(volume).partition(":")
        path = mount_path(text)
        if not DNS_SUBDOMAIN.fullmatch(claim) or path is None or path in taken:
            raise ConfigError(
                "launcher.volumes",
                volume,
                f"CLAIM:MOUNT_PATH, a PersistentVolumeClaim name and an absolute path without `..`, "
                f"other than / and {', '.join(sorted(taken))}",
                "e.g. launcher.volumes=[datasets:/data]; `kubectl get pvc` lists the claims.",
            )
        taken.add(path)


def check_runtime(run: Run) -> None:
    """Before anything is written: kubectl must be there, unless this is a dry run or a job's pod."""
    from disttrain.launch.kubeflow_env import kubeflow_node_env

    lc = cast(K8sLauncherConfig, run.launcher)
    if lc.dry_run or kubeflow_node_env() is not None:
        return
    if shutil.which(str(lc.kubectl)) is None:
        raise ConfigError(
            "launcher.kubectl",
            lc.kubectl,
            "a kubectl on PATH (or its path) configured for your cluster",
            "install kubectl (https://kubernetes.io/docs/tasks/tools/) and point it at the cluster, set "
            "launcher.kubectl=/path/to/kubectl, or launcher.dry_run=true to only write and print the manifest.",
        )
