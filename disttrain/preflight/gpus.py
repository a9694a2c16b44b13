"""The parent's GPU checks before launch: no more nccl ranks than GPUs on the node, no bf16 on GPUs
without bf16 tensor cores unless asked for, and no fp8 without float8 tensor cores unless emulated. `nproc_per_node=auto` became a number at
compose time (`disttrain.config.gpus`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from disttrain.config.errors import ConfigError
from disttrain.config.gpus import choose_backend

if TYPE_CHECKING:
    from disttrain.config.run import Run


def check_nccl_ranks(run: Run) -> int:
    """Refuse more local ranks than GPUs whenever the ranks would use nccl (`backend=auto` included:
    it becomes nccl in the ranks on a CUDA machine). Returns the node's visible GPUs (0 on CPU)."""
    import torch

    name, nproc = run.backend.name, run.world.nproc_per_node
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


def check_bf16(run: Run, gpus: int) -> None:
    """amp=bf16 on GPUs without bf16 tensor cores (compute capability < 8.0: V100, T4) passes
    torch.cuda.is_bf16_supported() (emulation) but runs several times slower than fp16: refused
    before launch, unless `amp.bf16_emulation=true` (then a warning)."""
    import torch

    amp = run.amp
    if amp.name != "bf16" or gpus == 0 or choose_backend(run.backend.name) != "nccl":
        return
    major, minor = torch.cuda.get_device_capability(0)
    if (major, minor) >= (8, 0):
        return
    name = torch.cuda.get_device_name(0)
    if amp.bf16_emulation:
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


FP8_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (L4, L40S, RTX 4090) and Hopper (H100) onwards


def check_fp8(run: Run, gpus: int) -> None:
    """amp=fp8 needs the ranks on GPUs of compute capability >= 8.9 (torch._scaled_mm's float8
    GEMMs), unless `amp.fp8_emulate=true`; and torchao installed. Refused before launch."""
    amp = run.amp
    if amp.name != "fp8":
        return
    if not amp.fp8_emulate:
        import torch

        on_gpus = gpus > 0 and choose_backend(run.backend.name) == "nccl"
        capability = torch.cuda.get_device_capability(0) if on_gpus else None
        if capability is None or capability < FP8_CAPABILITY:
            where = (
                f"{torch.cuda.get_device_name(0)} (compute capability {capability[0]}.{capability[1]})"
                if capability is not None
                else "CPU ranks" + (" (backend=gloo)" if gpus else " (no CUDA GPU visible)")
            )
            raise ConfigError(
                "amp",
                "fp8",
                f"off, bf16 or fp16 on {where}; fp8 needs GPUs of compute capability >= 8.9 (Ada, Hopper "
                "and newer: float8 tensor cores)",
                "use amp=bf16; or amp.fp8_emulate=true to check float8 numerics with emulated matmuls "
                "(slower than bf16, not a speed-up).",
            )
    from disttrain.strategies.float8 import check_torchao

    check_torchao()
