"""Inside a Kubeflow pod that runs `disttrain train` itself: the operator's variables as node settings.

Kubeflow Trainer v2 (a TrainJob on a torch runtime) gives every trainer pod PET_NNODES,
PET_NPROC_PER_NODE, PET_NODE_RANK (the Job completion index), PET_MASTER_ADDR
(`<job>-node-0-0.<job>`) and PET_MASTER_PORT (29500): kubeflow/trainer
pkg/runtime/framework/plugins/torch/torch.go. The v1 training-operator's PyTorchJob sets
MASTER_ADDR/PET_MASTER_ADDR (`<job>-master-0`), MASTER_PORT/PET_MASTER_PORT, RANK and PET_NODE_RANK
(the pod's index: master 0, worker i+1), WORLD_SIZE, PET_NNODES and, with spec.nprocPerNode,
PET_NPROC_PER_NODE: pkg/controller.v1/pytorch/envvar.go and master.go.

torchrun reads the PET_* variables itself; here disttrain plays torchrun's part (one launcher per
pod, `nproc_per_node` ranks each), so they become node_rank, master_addr and master_port — the
multi-node settings of the by-hand mode. Self-contained (only `os`): both the `launcher=k8s` pods
and an external-launcher mode can use it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

NODE_VARS = ("PET_NNODES", "PET_NODE_RANK")


def kubeflow_node_env(environ: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """{nodes, node_rank, nproc_per_node (None: 'auto'), master_addr, master_port} from the operator's
    variables, or None outside such a pod or inside a rank torchrun started (TORCHELASTIC_RUN_ID)."""
    env = os.environ if environ is None else environ
    if not all(env.get(k) for k in NODE_VARS) or "TORCHELASTIC_RUN_ID" in env:
        return None
    nnodes = re.fullmatch(r"\s*(?:\d+:)?(\d+)\s*", env["PET_NNODES"])  # PyTorchJob elastic: MIN:MAX
    nproc = env.get("PET_NPROC_PER_NODE", "auto")
    addr = env.get("PET_MASTER_ADDR") or env.get("MASTER_ADDR")
    port = env.get("PET_MASTER_PORT") or env.get("MASTER_PORT") or "29500"
    if nnodes is None or not env["PET_NODE_RANK"].isdigit() or not addr or not port.isdigit():
        return None
    return {
        "nodes": int(nnodes[1]),
        "node_rank": int(env["PET_NODE_RANK"]),
        "nproc_per_node": int(nproc) if nproc.isdigit() else None,
        "master_addr": addr,
        "master_port": int(port),
    }


def node_overrides(overrides: list[str], environ: Mapping[str, str] | None = None) -> list[str]:
    """`overrides` plus the operator's node settings (unless given): the job's shape comes from the
    environment, as torchrun takes it, so a PyTorchJob the user wrote around `python -m disttrain
    train` needs no nodes=/nproc_per_node= of its own (a launcher=k8s pod's frozen config agrees)."""
    node = kubeflow_node_env(environ)
    if node is None:
        return overrides
    given = {o.split("=", 1)[0].lstrip("+") for o in overrides}
    keys = ("nodes", "node_rank", "nproc_per_node", "master_addr", "master_port")
    return [*overrides, *(f"{k}={node[k]}" for k in keys if k not in given and node[k] is not None)]


def pod_node_overrides(overrides: list[str], environ: Mapping[str, str]) -> list[str] | None:
    """In a Kubeflow pod that is a node's launcher: `overrides` plus its node settings; else None."""
    return node_overrides(overrides, environ) if kubeflow_node_env(environ) is not None else None
