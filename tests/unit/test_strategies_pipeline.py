"""The pipeline's measured bubble times the device, not the host (review 2026-11-25-gpu-readiness
#11): on CUDA a call only queues kernels, so the compute of each timed chunk is read from CUDA events
on the stream. Here torch.cuda.Event is a fake whose clock the "kernels" advance while the host
returns at once."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from disttrain.dist import DistEnv
from disttrain.strategies import build_strategy
from disttrain.strategies.pipeline import DeviceClock


class FakeEvent:
    """A CUDA event on a fake stream: record() stamps the stream's clock (ms), which kernels advance."""

    stream_ms = 0.0
    done = True

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at: float | None = None

    def record(self, stream: Any = None) -> None:
        self.at = FakeEvent.stream_ms

    def query(self) -> bool:
        return FakeEvent.done

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.at is not None and end.at is not None
        return end.at - self.at


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> list[torch.device]:
    synced: list[torch.device] = []
    FakeEvent.stream_ms, FakeEvent.done = 0.0, True
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    return synced


def _kernel(ms: float) -> None:
    """Queue `ms` of device work: the host returns at once."""
    FakeEvent.stream_ms += ms


def test_pipeline_chunks_are_timed_on_the_device_stream(fake_cuda: list[torch.device]) -> None:
    cuda = torch.device("cuda", 1)
    strategy: Any = build_strategy({"name": "pipeline"}, DistEnv(1, 1, 2, 2, "nccl", cuda))
    chunk = strategy._timed(lambda: _kernel(7.0))
    for _ in range(3):
        chunk()
    FakeEvent.stream_ms += 100.0  # idle on the stream (waiting for a peer): not compute
    wall = strategy.wall.start()
    chunk()
    strategy.wall.stop(wall)
    assert fake_cuda == []  # nothing synchronises inside the step
    assert strategy.busy.seconds() == pytest.approx(0.028)
    assert strategy.wall.seconds() == pytest.approx(0.007)
    assert fake_cuda and all(d == cuda for d in fake_cuda)  # read once the kernels are done


def test_pending_events_settle_without_waiting(
    fake_cuda: list[torch.device], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(DeviceClock, "MAX_PENDING", 2)
    clock = DeviceClock(torch.device("cuda", 0))
    FakeEvent.done = False  # still running: nothing is read, nothing waits
    for _ in range(3):
        clock.stop(_start_then(clock, 1.0))
    assert len(clock._pending) == 3 and fake_cuda == []
    FakeEvent.done = True
    clock.stop(_start_then(clock, 1.0))  # over the limit: the completed pairs are read
    assert clock._pending == [] and clock._total == pytest.approx(0.004) and fake_cuda == []
    clock.reset()
    assert clock.seconds() == 0.0


def _start_then(clock: DeviceClock, ms: float) -> Any:
    token = clock.start()
    _kernel(ms)
    return token


def test_cpu_regions_are_host_time() -> None:
    clock = DeviceClock(torch.device("cpu"))
    token = clock.start()
    time.sleep(0.02)
    clock.stop(token)
    assert 0.02 <= clock.seconds() < 10.0  # host seconds (a loaded machine may oversleep)
