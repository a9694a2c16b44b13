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


def nccl_gpus(backend: str) -> int:
    """GPUs on this node the ranks would drive: 0 unless `backend` resolves to nccl here (dist.choose_backend)."""
    if "torch" not in sys.modules and _cpu_only_torch():
        return 0
    import torch

    from disttrain.dist import choose_backend

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


def check_nccl_ranks(cfg: dict[str, Any]) -> int:
    """Refuse more local ranks than GPUs whenever the ranks would use nccl (`backend=auto` included:
    it becomes nccl in the ranks on a CUDA machine). Returns the node's visible GPUs (0 on CPU)."""
    import torch

    from disttrain.dist import choose_backend

    name, nproc = str(cfg["backend"]["name"]), int(cfg["nproc_per_node"])
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if choose_backend(name) != "nccl":
        return gpus
    if gpus == 0:
        raise ConfigError(
            "backend",
            name,
            f"auto or gloo on this machine (torch.cuda.is_available() is False, torch {torch.__version__})",
            "nccl needs CUDA GPUs; use backend=gloo or backend=auto.",
        )
    if nproc > gpus and not _bound_per_task(nproc, gpus):
        via = "" if name == "nccl" else f" (backend={name} becomes nccl on this CUDA machine)"
        raise ConfigError(
            "nproc_per_node",
            nproc,
            f"<= {gpus} (the GPUs visible on this node) with nccl{via}",
            f"set nproc_per_node={gpus} or nproc_per_node=auto (one rank per GPU), "
            f"or backend=gloo to run {nproc} CPU ranks.",
        )
    return gpus


def _bound_per_task(nproc: int, gpus: int) -> bool:
    """Inside ranks an outside launcher started (srun --gpus-per-task=1): each sees only its own
    GPU(s), fewer than the local ranks; DistEnv.from_env (dist.cuda_index) already chose its device."""
    from disttrain.launch import launched_externally

    return launched_externally() and nproc % gpus == 0


def check_bf16(cfg: dict[str, Any], gpus: int) -> None:
    """amp=bf16 on GPUs without bf16 tensor cores (compute capability < 8.0: V100, T4) passes
    torch.cuda.is_bf16_supported() (emulation) but runs several times slower than fp16: refused
    before launch, unless `amp.bf16_emulation=true` (then a warning)."""
    import torch

    from disttrain.dist import choose_backend

    amp = cfg["amp"]
    if amp["name"] != "bf16" or gpus == 0 or choose_backend(str(cfg["backend"]["name"])) != "nccl":
        return
    major, minor = torch.cuda.get_device_capability(0)
    if (major, minor) >= (8, 0):
        return
    name = torch.cuda.get_device_name(0)
    if amp.get("bf16_emulation"):
        import logging

        logging.getLogger("disttrain").warning(
            "amp=bf16 on %s (compute capability %d.%d < 8.0) runs emulated, several times slower than "
            "amp=fp16 (amp.bf16_emulation=true)",
            name,
            major,
            minor,
        )
        return
    raise ConfigError(
        "amp",
        "bf16",
        f"off or fp16 on {name} (compute capability {major}.{minor}; bf16 tensor cores need 8.0, Ampere)",
        "use amp=fp16 (native on this GPU, with loss scaling; where the strategy allows it) or amp=off, or "
        "amp.bf16_emulation=true to run bf16 emulated (slowly) anyway.",
    )
