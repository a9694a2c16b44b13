"""An async save whose staging copy overlaps the next step: the checkpoint holds the state of the
step it was taken at, and training waits for the copy only before the state changes."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from unit_support import checkpoint_test_run

from disttrain import checkpoint
from disttrain.checkpoint.manager import Checkpointer, ModelState, run_info
from disttrain.config.schema import CheckpointConfig
from disttrain.dist import DistEnv
from disttrain.engine.state import TrainState
from disttrain.strategies.base import Strategy
from disttrain.strategies.specs.data_parallel import SingleStrategyConfig

pytestmark = [pytest.mark.timeout(60), pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

ENV = DistEnv(0, 0, 1, 1, "gloo", torch.device("cpu"))
RUN = checkpoint_test_run()  # what run_info's meta.json records


class Counter:
    """A user's own Stateful whose tensor changes in place."""

    def __init__(self) -> None:
        self.n = torch.zeros(3)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.n = state["n"].clone()


def _manager(
    tmp_path: Path, model: nn.Module
) -> tuple[Checkpointer, torch.optim.Optimizer, TrainState, Counter]:
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, 4)).sum().backward()
    opt.step()
    state, counter = TrainState(), Counter()
    states = {"model": ModelState(Strategy(SingleStrategyConfig(), ENV), model, opt), "train": state}
    states["counter"] = counter  # type: ignore[assignment]
    cfg = CheckpointConfig(keep=5, verify="hash")
    setattr(cfg, "async", True)
    ckpt = Checkpointer(cfg, tmp_path, ENV, states, run_info=run_info(RUN, "single", 1, 1, 32))
    return ckpt, opt, state, counter


def test_the_checkpoint_holds_the_saved_step_while_the_next_one_changes_everything(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 2))
    ckpt, opt, state, counter = _manager(tmp_path, model)
    assert not ckpt._saved_buffers
    state.step = 3
    counter.n += 7
    want = {k: v.clone() for k, v in model.state_dict().items()}
    want_moment = opt.state[next(iter(model.parameters()))]["exp_avg"].clone()
    ckpt.save("periodic")
    counter.n += 1  # a user state changed right after the save returned: copied already
    ckpt.staged("forward")  # no saved buffers: the forward does not wait
    model(torch.randn(4, 4)).sum().backward()
    ckpt.staged("update")
    assert ckpt.pending is not None and ckpt.pending.is_staged()
    opt.step()
    ckpt.finish()
    path = tmp_path / checkpoint.step_name(3)
    assert checkpoint.problem(path) is None
    torch.manual_seed(1)
    fresh = nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 2))
    other, opt2, _, counter2 = _manager(tmp_path / "other", fresh)
    other.restore(path)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in want.items())
    assert torch.equal(opt2.state[next(iter(fresh.parameters()))]["exp_avg"], want_moment)
    assert torch.equal(counter2.n, torch.full((3,), 7.0))
    assert len(ckpt.stalls) == 1 and ckpt.stalls[0] >= 0


def test_a_model_with_saved_buffers_waits_for_the_copy_before_its_forward(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
    ckpt, _, state, _ = _manager(tmp_path, model)
    assert ckpt._saved_buffers
    state.step = 1
    ckpt.save("periodic")
    ckpt.staged("forward")
    assert ckpt.pending is not None and ckpt.pending.is_staged()
    ckpt.finish()


def test_while_an_overlapped_save_is_in_flight_the_last_committed_one_stays_choosable(tmp_path: Path) -> None:
    """The in-flight save writes into .tmp-: the committed checkpoint before it stays whole (a kill
    mid-save: tests/integration/test_faults.py)."""
    model = nn.Sequential(nn.Linear(4, 8))
    ckpt, _, state, _ = _manager(tmp_path, model)
    state.step = 1
    ckpt.save("periodic")
    ckpt.finish()
    state.step = 2
    ckpt.save("periodic")
    deadline = time.monotonic() + 30
    while not ckpt.pending.ready() and time.monotonic() < deadline:  # type: ignore[union-attr]
        assert checkpoint.choose(tmp_path) is not None
    ckpt.finish()
    assert checkpoint.choose(tmp_path) == tmp_path / checkpoint.step_name(2)


def test_async_staging_is_pinned_and_non_blocking_on_cuda_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Review #13: on CUDA an async save stages into pinned memory with non-blocking copies (on DCP's
    staging stream, beside the training kernels); on CPU plain memory and blocking copies (torch
    refuses non-blocking staging without an accelerator). The rank's device decides."""
    import torch.distributed.checkpoint.staging as staging

    from disttrain.checkpoint import writing as ckpt_writing

    cuda, cpu = (
        ckpt_writing.staging_options(torch.device("cuda", 3)),
        ckpt_writing.staging_options(torch.device("cpu")),
    )
    assert (cuda.use_pinned_memory, cuda.use_non_blocking_copy, cuda.use_async_staging) == (True, True, True)
    assert (cpu.use_pinned_memory, cpu.use_non_blocking_copy, cpu.use_async_staging) == (False, False, True)
    assert not cuda.use_shared_memory and not cpu.use_shared_memory

    built: list[staging.StagingOptions] = []
    monkeypatch.setattr(staging, "DefaultStager", lambda options: built.append(options))
    # both class attributes, restored together: a stager left as this fake's None beside a real
    # executor made a later async save in this process fail ('NoneType' has no attribute 'stage')
    monkeypatch.setattr(ckpt_writing._Background, "executor", None)
    monkeypatch.setattr(ckpt_writing._Background, "stager", None)
    executor, _ = ckpt_writing._Background.start(torch.device("cuda", 3))
    executor.shutdown()
    assert built == [cuda]


def test_cuda_staging_before_torch_2_13_gets_a_fresh_stager_per_save(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.11's DefaultStager closes its StateDictStager after each non-blocking stage (the
    second async save on an H100 failed: KeyError <class 'type'>): there every save builds one."""
    import torch.distributed.checkpoint.staging as staging

    from disttrain.checkpoint import writing as ckpt_writing

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert ckpt_writing.stager_reusable(cuda, "2.13.0+cu130") and ckpt_writing.stager_reusable(
        cuda, "2.14.0a0+git1"
    )
    assert not ckpt_writing.stager_reusable(cuda, "2.11.0+cu130") and ckpt_writing.stager_reusable(
        cpu, "2.11.0"
    )

    built: list[object] = []
    monkeypatch.setattr(staging, "DefaultStager", lambda options: built.append(object()) or built[-1])
    monkeypatch.setattr(ckpt_writing._Background, "executor", None)
    monkeypatch.setattr(ckpt_writing._Background, "stager", None)
    for reusable, expected in ((True, 1), (False, 3)):
        built.clear()
        monkeypatch.setattr(ckpt_writing._Background, "stager", None)
        monkeypatch.setattr(ckpt_writing, "stager_reusable", lambda device, r=reusable: r)
        stagers = [ckpt_writing._Background.start(cuda)[1] for _ in range(3)]
        assert len(built) == expected and len({id(s) for s in stagers}) == expected
    assert ckpt_writing._Background.executor is not None
    ckpt_writing._Background.executor.shutdown()


def test_the_manager_stages_from_the_ranks_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[torch.device | None] = []
    real = checkpoint.save
    monkeypatch.setattr(
        checkpoint, "save", lambda *a, **kw: (seen.append(kw.get("device")), real(*a, **kw))[1]
    )
    ckpt, *_ = _manager(tmp_path, nn.Linear(4, 2))
    ckpt.save("test")
    ckpt.finish()
    assert seen == [ENV.device]


def test_one_rank_on_cuda_waits_for_the_step_before_staging(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review 2026-11-28-gpu G1: DCP's stager copies on its own stream and never waits on the
    compute stream; with one rank no barrier orders them, so the device's current stream (the
    optimizer step's kernels) is synchronized before `stage()`. Mocked CUDA: the order of the two
    calls, and the stream asked for is the rank's device's."""
    from concurrent.futures import Future, ThreadPoolExecutor

    from disttrain.checkpoint import writing as ckpt_writing

    calls: list[Any] = []

    class Stream:
        def synchronize(self) -> None:
            calls.append("synchronize")

    class Stager:
        def stage(self, state: dict[str, Any]) -> Future:
            calls.append("stage")
            done: Future = Future()
            done.set_result(state)
            return done

    executor = ThreadPoolExecutor(max_workers=1)
    monkeypatch.setattr(ckpt_writing._Background, "start", classmethod(lambda cls, d: (executor, Stager())))
    monkeypatch.setattr(ckpt_writing._Background, "in_flight", None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: calls.append(device) or Stream())
    monkeypatch.setattr(ckpt_writing, "_write_and_commit", lambda *a, **kw: calls.append("write"))
    cuda = torch.device("cuda", 0)
    meta = {"step": 1, "epoch": 0, "epoch_samples": 0, "samples": 0, "reason": "test"}
    pending = checkpoint.save(
        tmp_path, 1, {"model": {"w": torch.ones(2)}}, {}, meta, rank=0, keep=2, verify="size",
        async_save=True, overlap_staging=True, device=cuda,
    )  # fmt: skip
    pending.wait()
    executor.shutdown()
    assert calls == [cuda, "synchronize", "stage", "write"]
