"""How many GPUs a run's ranks would drive, decided once in the parent: `nproc_per_node=auto`
becomes a number before the config is frozen (ranks never see `auto`), and more nccl ranks than
GPUs on the node is refused before any rank starts.

Importing this module does not import torch: with a CPU-only build of torch installed (its
version ends in `+cpu`) the answer is 0 GPUs without importing it, so `disttrain config` stays fast.
"""

from __future__ import annotations

import sys
from typing import Any

from disttrain.config.errors import ConfigError

AUTO = "auto"
CPU_RANKS = 2  # `auto` without GPUs: two CPU ranks, enough to exercise every collective


def choose_backend(name: str) -> str:
    """`auto` is nccl when CUDA GPUs are present, else gloo."""
    if name == "auto":
        import torch
        import torch.distributed as dist

        return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    return name


def nccl_gpus(backend: str) -> int:
    """GPUs on this node the ranks would drive: 0 unless `backend` resolves to nccl here (choose_backend)."""
    if "torch" not in sys.modules and _cpu_only_torch():
        return 0
    import torch

    if choose_backend(backend) != "nccl" or not torch.cuda.is_available():
        return 0
    return int(torch.cuda.device_count())


def _requested_gpus(cfg: dict[str, Any]) -> int:
    """A scheduler's job (launcher=slurm/k8s) asks for `launcher.gpus_per_node` on nodes that are not
    this (login) machine: `auto` means one rank per GPU asked for there."""
    launcher = cfg.get("launcher")
    asked = launcher.get("gpus_per_node") if isinstance(launcher, dict) else None
    return asked if isinstance(asked, int) and not isinstance(asked, bool) and asked > 0 else 0


def _cpu_only_torch() -> bool:
    """The installed torch is a CPU-only wheel (`2.13.0+cpu`): it can never see a GPU."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch").endswith("+cpu")
    except PackageNotFoundError:
        return False


def resolve_nproc(cfg: dict[str, Any]) -> None:
    """`nproc_per_node=auto` becomes one rank per GPU when the backend resolves to nccl, else 2;
    a number stays (as an int). Called by `resolve`, so every later reader sees an int."""
    value: Any = cfg.get("nproc_per_node")
    if value == AUTO:
        cfg["nproc_per_node"] = _requested_gpus(cfg) or nccl_gpus(str(cfg["backend"]["name"])) or CPU_RANKS
        return
    if isinstance(value, bool) or not str(value).strip().isdigit() or int(value) < 1:
        raise ConfigError(
            "nproc_per_node",
            value,
            "auto (one rank per GPU with nccl, else 2) or an integer >= 1",
            "one rank per GPU; on CPU 2 is a good start; auto picks for you.",
        )
    cfg["nproc_per_node"] = int(value)
