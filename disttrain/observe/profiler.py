"""profile=true: one torch.profiler window (wait, warmup, active steps) per rank, written as
TensorBoard-readable Chrome traces to RUN_DIR/profile/rank<N>.*.pt.trace.json."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from disttrain.config.schema import ProfilerConfig

log = logging.getLogger("disttrain")


class NullProfiler:
    def __enter__(self) -> NullProfiler:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def step(self) -> None:
        return None


def make_profiler(enabled: bool, window: ProfilerConfig, run_dir: Path, rank: int) -> Any:
    if not enabled:
        return NullProfiler()
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    out = run_dir / "profile"
    wait, warmup, active = window.wait, window.warmup, window.active
    if rank == 0:
        log.info("profiling steps %d..%d into %s", wait + warmup + 1, wait + warmup + active, out)
    return profile(
        activities=activities,
        schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=1),
        on_trace_ready=tensorboard_trace_handler(str(out), worker_name=f"rank{rank}"),
    )
