"""Start-up phase marks for `scripts/bench_first_step.py`: where the time to the first step goes.

With DISTTRAIN_TIMING=FILE set, every process (the CLI parent, the torchrun agent, each rank)
appends one line per phase: `time.time() pid rank phase cpu_seconds`. Unset, `mark` is a dict lookup. This
module imports nothing heavy: the CLI marks its first phase before Hydra or torch is imported.
"""

from __future__ import annotations

import os
import time

ENV = "DISTTRAIN_TIMING"


def mark(phase: str, at: float | None = None) -> None:
    path = os.environ.get(ENV)
    if not path:
        return
    cpu = 0.0 if at is not None else time.process_time()  # this process's CPU seconds: load-proof
    line = f"{time.time() if at is None else at:.6f} {os.getpid()} {os.environ.get('RANK', '-')} {phase} {cpu:.4f}\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line.encode())  # one write with O_APPEND: lines of several processes never mix
    finally:
        os.close(fd)


def mark_process_start(phase: str) -> None:
    """`phase` at the time this process was started (Linux /proc, 10 ms ticks): before any import."""
    if not os.environ.get(ENV):
        return
    started = process_start_time()
    if started is not None:
        mark(phase, started)


def process_start_time(pid: int | None = None) -> float | None:
    """When process `pid` (this one) started, on time.time()'s scale (Linux /proc, 10 ms ticks)."""
    try:
        with open(f"/proc/{pid or os.getpid()}/stat", encoding="ascii") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # starttime, ticks after boot
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
