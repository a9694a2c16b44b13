"""Training progress on rank 0: the rich bar on a TTY, plain periodic lines anywhere else.

Every `log_every` steps one line `step 120/2000 loss 1.234 lr 3.0e-4 1,234 samples/s eta 4m10s`
goes to the log: to `logs/rank0.log` always, and to the console (stderr) unless the rich bar is
showing the same numbers there. Batch jobs (Slurm, nohup, CI) so see progress while they train.
"""

from __future__ import annotations

import time
from typing import Any

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from disttrain.observe.log import FILE_ONLY, console, get_logger


class NullProgress:
    def __enter__(self) -> NullProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def update(self, step: int, **fields: Any) -> None:
        pass


def _duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def progress_line(step: int, total: int, fields: dict[str, Any], eta_s: float | None) -> str:
    """`step 120/2000 loss 1.234 lr 3.0e-4 1,234 samples/s eta 4m10s` (absent fields left out)."""
    parts = [f"step {step}/{total}"]
    if fields.get("loss") is not None:
        parts.append(f"loss {fields['loss']:.4g}")
    if fields.get("lr") is not None:
        parts.append(f"lr {fields['lr']:.1e}")
    if fields.get("samples_per_s") is not None:
        parts.append(f"{fields['samples_per_s']:,.0f} samples/s")
    if eta_s is not None:
        parts.append(f"eta {_duration(eta_s)}")
    return " ".join(parts)


class LogProgress(NullProgress):
    """One plain log line per update with metrics; `to_console=False` keeps it in the file only."""

    def __init__(self, total: int, to_console: bool = True) -> None:
        self.total, self.to_console = total, to_console
        self._start: tuple[int, float] | None = None

    def update(self, step: int, **fields: Any) -> None:
        now = time.perf_counter()
        if self._start is None:
            self._start = (step, now)
        if not fields:  # the initial position (0, or the resumed step): no metrics to report yet
            return
        done, began = step - self._start[0], self._start[1]
        eta = (now - began) / done * (self.total - step) if done > 0 else None
        extra = {} if self.to_console else {FILE_ONLY: True}
        get_logger().info(progress_line(step, self.total, fields, eta), extra=extra)


class RichProgress(NullProgress):
    def __init__(self, total: int, description: str) -> None:
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console,
            transient=False,
            refresh_per_second=4,
        )
        self._task = self._progress.add_task(description, total=total, status="")
        self._lines = LogProgress(total, to_console=False)  # the same numbers into rank0.log

    def __enter__(self) -> RichProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._progress.stop()

    def update(self, step: int, **fields: Any) -> None:
        self._lines.update(step, **fields)
        shown = {k: v for k, v in fields.items() if k in ("loss", "lr")}
        status = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in shown.items())
        self._progress.update(self._task, completed=step, status=status)


def make_progress(is_zero: bool, bar: bool, total: int, description: str) -> NullProgress:
    """Rank 0: the rich bar when `bar` and the console is a terminal, else plain lines."""
    if not is_zero:
        return NullProgress()
    if bar and console.is_terminal:
        return RichProgress(total, description)
    return LogProgress(total)
