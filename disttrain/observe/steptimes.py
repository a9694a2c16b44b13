"""Each training step's time on this rank, for the step-time p50/p95 in `summary.json` (the straggler
check of `disttrain show`): the step's data wait plus the step itself, measured on the clock of the
device that runs it.

On an accelerator a step's host time is how fast the host queued its kernels, not how long they ran:
a GPU-bound run's host times flatter it, and the queue's drain lands in no step. There a pair of
timing events (`torch.Event(enable_timing=True)`) brackets each step on the device's current stream,
the first recorded when the step's data wait starts: the device reaches it when it has finished the
work queued before, so a data wait counts where the device idled through it and not where it
overlapped the previous steps' queued work. The events are read only where the engine has already
waited for the device (the log step's loss read, the end of training), or, when very many are
pending, the oldest already completed ones are read without waiting. Nothing synchronises inside a
step.

On CPU ops run when called, so the host clock is the step's time. A wait the engine does later for
the device (the log step's loss read) is still shared out over the steps since the previous one, so
that no drain is lost and the steps add up to no more than the wall time.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

KEPT = 10_000  # per rank: the step-time quantiles cover the last this many steps
AUTO: Any = object()  # StepClock's `events`: the device's own timing events, or the host clock


def device_events(device: torch.device) -> Callable[[], Any] | None:
    """A factory of timing events on `device`'s stream, or None: time on the host (CPU, or a device
    without timing events). The generic `torch.Event`, else `torch.cuda.Event`: the first whose two
    events, recorded once here and waited for (one wait, at setup), give an elapsed time."""
    if device.type == "cpu":
        return None
    kinds: list[Callable[[], Any]] = [partial(torch.Event, device=device, enable_timing=True)]
    if device.type == "cuda":
        kinds.append(partial(torch.cuda.Event, enable_timing=True))
    for kind in kinds:
        try:
            start, end = kind(), kind()
            start.record()
            end.record()
            end.synchronize()
            start.elapsed_time(end)
        except (RuntimeError, TypeError, ValueError):
            continue
        return kind
    return None


class StepClock:
    """Mark each step (`began = begin()` when its data wait starts ... `end(began)` once it is
    queued), resolve where the engine has synced (`synced`), read the seconds of the last `kept`
    steps (`seconds`).

    `events`: a factory of timing events (objects with `record()`, `query()`, `synchronize()` and
    `elapsed_time(end)` in milliseconds, as `torch.Event`), None for the host clock, or AUTO: the
    device's own where it has them (`device_events`).
    """

    MAX_PENDING = 4096  # steps whose events are held before the completed ones are read

    def __init__(self, device: torch.device, kept: int = KEPT, events: Any = AUTO) -> None:
        self.times: deque[float] = deque(maxlen=kept)  # resolved steps, in order
        self.events: Callable[[], Any] | None = device_events(device) if events is AUTO else events
        self._pending: list[tuple[Any, Any]] = []  # (start event, end event) of unread steps
        # `began = clock.begin()`: the host clock's reading itself (no call of ours per step), or a
        # start event recorded on the device's stream
        self.begin: Callable[[], Any] = time.perf_counter if self.events is None else self._record

    def _record(self) -> Any:
        assert self.events is not None
        event = self.events()
        event.record()
        return event

    def end(self, began: Any) -> None:
        """The step that `began` (begin's value, at the start of its data wait) has been queued."""
        if self.events is None:
            self.times.append(time.perf_counter() - began)
            return
        self._pending.append((began, self._record()))
        if len(self._pending) > self.MAX_PENDING:
            self._resolve(wait=False)

    def synced(self, steps: int, waited: float) -> None:
        """The engine has just waited `waited` seconds for the device to finish what it had queued,
        the work of the last `steps` steps. Device clock: read their events (complete now, so
        nothing waits). Host clock: each of those steps gets an equal share of the wait."""
        if self.events is not None:
            self._resolve(wait=True)
            return
        if steps <= 0 or waited <= 0:
            return
        share = waited / steps  # a step no longer kept takes its share with it
        for i in range(1, min(steps, len(self.times)) + 1):
            self.times[-i] += share

    def seconds(self) -> list[float]:
        """The last `kept` steps' seconds, oldest first (the end of training: waits for the device
        to finish the steps still pending)."""
        self._resolve(wait=True)
        return list(self.times)

    def _resolve(self, wait: bool) -> None:
        if not self._pending:
            return
        if wait:
            self._pending[-1][1].synchronize()  # the stream's last step: every earlier one is done
        done = 0
        for start, end in self._pending:
            if not (wait or end.query()):
                break
            self.times.append(start.elapsed_time(end) / 1000.0)  # ms
            done += 1
        del self._pending[:done]
