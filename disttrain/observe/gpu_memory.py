"""Peak CUDA memory of the run, for OOM triage: torch's caching-allocator high-water marks
(`max_memory_allocated`: tensors; `max_memory_reserved`: what the allocator holds from the driver),
the maximum over ranks, at log steps and in summary.json. Nothing on CPU (the keys are absent)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from disttrain.dist import DistEnv

ALLOCATED, RESERVED = "gpu_mem_allocated_peak_gib", "gpu_mem_reserved_peak_gib"
GIB = 2**30


def reset_peaks(env: DistEnv) -> None:
    """Start the high-water marks at what the rank holds now (the model and optimizer state)."""
    if env.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(env.device)


def peaks(env: DistEnv) -> dict[str, float]:
    """The peaks since `reset_peaks`, GiB, maximum over ranks: a collective of every rank on CUDA."""
    if env.device.type != "cuda":
        return {}
    mine = torch.tensor(
        [torch.cuda.max_memory_allocated(env.device), torch.cuda.max_memory_reserved(env.device)],
        dtype=torch.float64,
    )
    if dist.is_initialized() and env.world_size > 1:
        on_device = mine.to(env.device)  # nccl reduces device tensors only
        dist.all_reduce(on_device, op=dist.ReduceOp.MAX)
        mine = on_device.cpu()
    return {ALLOCATED: round(float(mine[0]) / GIB, 3), RESERVED: round(float(mine[1]) / GIB, 3)}
