"""disttrain.observe.steptimes.StepClock on its own: what it reads without waiting, and how a wait
is shared (the engine's use of it: tests/unit/test_engine.py)."""

from __future__ import annotations

import pytest
import torch

from disttrain.observe.steptimes import StepClock, device_events


class Event:
    """A timing event that completes when the test says so (`done`); its clock is `at` (ms)."""

    waited = 0

    def __init__(self, at: list[float], done: list[bool]) -> None:
        self.clock, self.done, self.at = at, done, -1.0

    def record(self) -> None:
        self.at = self.clock[0]
        self.clock[0] += 1000.0  # one device second between two records

    def query(self) -> bool:
        return self.at < self.done[0]

    def synchronize(self) -> None:
        Event.waited += 1

    def elapsed_time(self, end: Event) -> float:
        assert self.query() and end.query(), "read before it completed"
        return end.at - self.at


def test_many_pending_steps_are_read_as_they_complete_without_waiting() -> None:
    """log_every far above MAX_PENDING: the completed steps' events are read (and let go) without a
    wait; the first one still running stops the reading, and the rest wait for the end."""
    clock, done = [0.0], [0.0]
    steps = StepClock(torch.device("cpu"), events=lambda: Event(clock, done))
    steps.MAX_PENDING = 4
    Event.waited = 0
    done[0] = 5_500.0  # the device finished the first 2 steps (their events at 0-1000, 2000-3000, ...)
    for _ in range(5):
        steps.end(steps.begin())
    assert list(steps.times) == [1.0, 1.0, 1.0] and len(steps._pending) == 2 and Event.waited == 0
    done[0] = float("inf")
    assert steps.seconds() == [1.0] * 5 and Event.waited == 1 and not steps._pending


def test_a_wait_on_the_host_clock_is_shared_by_the_steps_it_drained() -> None:
    """Host clock: a wait of 1 s after 4 steps adds 0.25 s to each; after more steps than are kept,
    only the kept ones get a share (the others' shares are gone with them)."""
    steps = StepClock(torch.device("cpu"), kept=3)
    assert steps.begin is __import__("time").perf_counter  # the step's own clock reading, no call of ours
    for _ in range(4):
        steps.end(steps.begin())
    before = list(steps.times)
    steps.synced(4, 1.2)
    assert list(steps.times) == pytest.approx([b + 0.3 for b in before])
    steps.synced(0, 5.0)  # no step since the last wait: nothing to share
    assert list(steps.times) == pytest.approx([b + 0.3 for b in before])


def test_a_device_without_timing_events_is_timed_on_the_host() -> None:
    """The meta device makes a `torch.Event` but cannot record one: the host clock, no error."""
    assert device_events(torch.device("meta")) is None
    assert StepClock(torch.device("meta")).events is None and StepClock(torch.device("cpu")).events is None
