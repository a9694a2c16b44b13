"""Training progress on rank 0: the rich bar on a TTY (every step), plain periodic lines anywhere else.

Every `log_every` steps one line `step 120/2000 loss 1.234 lr 3.0e-4 1,234 samples/s eta 4m10s`
goes to the log: to `logs/rank0.log` always, and to the console (stderr) unless the rich bar is
showing the same numbers there. Batch jobs (Slurm, nohup, CI) so see progress while they train.
"""

from __future__ import annotations

import time
from collections import deque
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

    def advance(self, step: int, epoch: int, samples: int, tokens: int) -> None:
        """After every step: `samples` and `tokens` of that step across the replicas."""


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


class Rates:
    """Steps, samples and tokens per second over the last WINDOW_S seconds of steps (this rank's
    clock: no collective), for the bar between two log steps."""

    WINDOW_S = 5.0

    def __init__(self) -> None:
        self._marks: deque[tuple[float, int, int, int]] = deque()  # (time, step, samples, tokens)
        self.samples = self.tokens = 0

    def add(self, step: int, samples: int, tokens: int, now: float) -> None:
        self.samples += samples
        self.tokens += tokens
        self._marks.append((now, step, self.samples, self.tokens))
        while len(self._marks) > 2 and now - self._marks[1][0] > self.WINDOW_S:
            self._marks.popleft()

    def per_second(self) -> tuple[float, float, float] | None:
        """(steps, samples, tokens) per second, or None before two steps."""
        if len(self._marks) < 2:
            return None
        (t0, step0, samples0, tokens0), (t1, step1, samples1, tokens1) = self._marks[0], self._marks[-1]
        elapsed = max(t1 - t0, 1e-9)
        return (step1 - step0) / elapsed, (samples1 - samples0) / elapsed, (tokens1 - tokens0) / elapsed


def _rate(value: float, unit: str) -> str:
    return f"{value / 1e6:.2f}M {unit}/s" if value >= 1e6 else f"{value:,.0f} {unit}/s"


class RichProgress(NullProgress):
    """The bar on a terminal: step/total, epoch, it/s, samples/s (tokens/s for a language model),
    loss and lr of the last log step, elapsed time and ETA. `advance` after every step (a few
    microseconds: rich redraws from its own thread, 4 times a second), `update` at log steps."""

    def __init__(self, total: int, description: str, epochs: int | None = None) -> None:
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(bar_width=24),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rates]}"),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=console,
            transient=False,
            refresh_per_second=4,
        )
        self._task = self._progress.add_task(description, total=total, status="", rates="")
        self._lines = LogProgress(total, to_console=False)  # the same numbers into rank0.log
        self._epochs = epochs
        self._rates = Rates()
        self._status = ""

    def __enter__(self) -> RichProgress:
        self._progress.start()
        _LIVE.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Stop the live display (its line ends): also on a second Ctrl-C, before the rank dies."""
        if self in _LIVE:
            _LIVE.remove(self)
        self._progress.stop()

    def advance(self, step: int, epoch: int, samples: int, tokens: int) -> None:
        self._rates.add(step, samples, tokens, time.perf_counter())
        rates = self._rates.per_second()
        parts = [] if self._epochs is None else [f"epoch {min(epoch + 1, self._epochs)}/{self._epochs}"]
        if rates is not None:
            its, per_sample, per_token = rates
            parts.append(f"{its:.3g} it/s" if its < 100 else f"{its:,.0f} it/s")
            parts.append(_rate(per_token, "tok") if per_token else _rate(per_sample, "samples"))
        self._progress.update(self._task, completed=step, rates=" ".join(parts))

    def update(self, step: int, **fields: Any) -> None:
        self._lines.update(step, **fields)
        shown = {k: v for k, v in fields.items() if k in ("loss", "lr")}
        status = " ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in shown.items())
        self._progress.update(self._task, completed=step, status=status)


_LIVE: list[RichProgress] = []


def close_live() -> None:
    """End every live bar of this process (a rank about to die on a second signal)."""
    for bar in list(_LIVE):
        bar.close()


def make_progress(
    is_zero: bool, bar: bool, total: int, description: str, epochs: int | None = None
) -> NullProgress:
    """Rank 0: the rich bar when `bar` and the console is a terminal, else plain lines."""
    if not is_zero:
        return NullProgress()
    if bar and console.is_terminal:
        return RichProgress(total, description, epochs)
    return LogProgress(total)
