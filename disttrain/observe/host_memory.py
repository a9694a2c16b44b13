"""Each rank's peak resident memory on its host since training started, for host-memory triage (a
data set read whole into every rank, a leak), as gpu_memory is for the device: summary.json's
`host_rss_peak_mib_by_rank` (rank order) and `host_rss_peak_mib` (their maximum).

Linux: VmHWM of /proc/self/status (the high-water mark of the process's resident set), reset to
the resident set when training starts through /proc/self/clear_refs (a rank forked from a larger
parent, the fork server, starts with that parent's mark). Elsewhere: ru_maxrss, since the process
started.

Also the Python heap during training (`frozen_heap`)."""

from __future__ import annotations

import contextlib
import gc
import resource
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from disttrain.dist import DistEnv

BY_RANK, PEAK = "host_rss_peak_mib_by_rank", "host_rss_peak_mib"
MIB = 2**20
_STATUS, _CLEAR_REFS = Path("/proc/self/status"), Path("/proc/self/clear_refs")


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Training with the objects made before it (torch's, the config's, the model's: ~340k for
    the CPU default job) out of the garbage collector's reach, as `gc.freeze` documents; the
    collector stays on for what training makes (a user's loss may leave cycles every step).

    Without it each rank's first full collection during training scanned them all, 0.3-0.45 s on
    a 2-core machine, at a step of its own: its peers waited for it in the next collective, one
    stall per rank. That was bench_overhead's whole step-time gap on the idle machine (1.29-1.31
    with a stall per rank in the 120-step window, issue 34); gc.callbacks showed it. The young
    generations are collected first, so the setup's recent garbage is not kept; at the end the
    objects go back to the collector (`gc.unfreeze`), so a process that trains again (tests,
    notebooks) frees the previous run's cycles."""
    gc.collect(1)
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def reset_peak() -> None:
    """Start this process's high-water mark at its resident memory now (Linux 4.0+: `5` to
    clear_refs); a no-op where the kernel has no such file or refuses the write."""
    with contextlib.suppress(OSError):
        _CLEAR_REFS.write_text("5")


def peak_bytes() -> int:
    """This process's peak resident memory: VmHWM where /proc has it, else ru_maxrss."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024  # macOS: bytes; Linux: KiB


def peaks(env: DistEnv) -> dict[str, float | list[float]]:
    """Every rank's peak (MiB, one small all-reduce: each rank fills its own slot) and the maximum."""
    table = torch.zeros(env.world_size, dtype=torch.float64)
    table[env.rank] = peak_bytes() / MIB
    if dist.is_initialized() and env.world_size > 1:
        on_device = table.to(env.device)  # nccl reduces device tensors only
        dist.all_reduce(on_device)
        table = on_device.cpu()
    by_rank = [round(x, 1) for x in table.tolist()]
    return {BY_RANK: by_rank, PEAK: max(by_rank)}
