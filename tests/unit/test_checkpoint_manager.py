"""disttrain.checkpoint.manager with explicit state objects and no engine: what goes where, a
restore that brings every state back, fallback past a checkpoint that does not load, and states a
checkpoint does not hold."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from unit_support import checkpoint_test_run

from disttrain.checkpoint import committed, read_meta
from disttrain.checkpoint.manager import Checkpointer, ModelState, run_info
from disttrain.config.schema import CheckpointConfig
from disttrain.dist import DistEnv
from disttrain.engine.state import TrainState
from disttrain.strategies.base import Strategy
from disttrain.strategies.specs.data_parallel import SingleStrategyConfig

pytestmark = pytest.mark.timeout(60)

ENV = DistEnv(0, 0, 1, 1, "gloo", torch.device("cpu"))
RUN = checkpoint_test_run()  # what run_info's meta.json records


class Counter:
    """A user's own Stateful: saved under its name in the sharded checkpoint."""

    def __init__(self) -> None:
        self.n = torch.zeros(3)

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n = state["n"].clone()


def parts() -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return model, opt, sched


def manager(directory: Path, **extra: Any) -> tuple[Checkpointer, nn.Module, Any, TrainState, Counter]:
    model, opt, sched = parts()
    state, counter = TrainState(), Counter()
    states = {
        "model": ModelState(Strategy(SingleStrategyConfig(), ENV), model, opt),
        "scheduler": sched,
        "train": state,
    }
    states["counter"] = counter  # type: ignore[assignment]
    cfg = CheckpointConfig(keep=5, verify="hash")
    info = run_info(RUN, "single", 1, 1, 32)
    return Checkpointer(cfg, directory, ENV, states, run_info=info, **extra), model, opt, state, counter


def train(model: nn.Module, opt: torch.optim.Optimizer, sched: Any, state: TrainState, steps: int) -> None:
    for _ in range(steps):
        model(torch.randn(5, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        state.step += 1
        state.samples += 32
        state.epoch_samples += 32


def test_save_writes_the_train_state_and_run_info_into_meta_and_the_rest_into_dcp(tmp_path: Path) -> None:
    ckpt, _, _, state, counter = manager(tmp_path, extra_meta=lambda: {"trackers": {"x": 1}})
    state.step, state.samples, state.last_val = 7, 224, {"val/loss": 0.5}
    counter.n += 2
    ckpt.save("periodic")
    [path] = committed(tmp_path)
    meta = read_meta(path)
    assert {k: meta[k] for k in ("step", "samples", "epoch", "epoch_samples", "last_val")} == {
        "step": 7, "samples": 224, "epoch": 0, "epoch_samples": 0, "last_val": {"val/loss": 0.5},
    }  # fmt: skip
    assert meta["states"] == ["counter", "model", "scheduler"] and meta["reason"] == "periodic"
    assert meta["global_batch"] == 32 and meta["strategy"] == "single" and meta["trackers"] == {"x": 1}
    assert meta["config_hash"] == run_info(RUN, "single", 1, 1, 32)["config_hash"]
    from torch.distributed.checkpoint import FileSystemReader

    keys = set(FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    assert "model.0.weight" in keys  # the model's keys at the top level (what `export` reads)
    assert "counter.n" in keys and any(k.startswith("optim.") for k in keys)
    assert any(k.startswith("scheduler.") for k in keys)
    ckpt.save("periodic")  # the same step again: nothing new
    assert len(committed(tmp_path)) == 1


def test_resume_restores_every_state_object(tmp_path: Path) -> None:
    ckpt, model, opt, state, counter = manager(tmp_path)
    sched = ckpt.states["scheduler"]
    train(model, opt, sched, state, 3)
    counter.n += 1
    ckpt.save("periodic")
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = json.dumps(opt.state_dict()["param_groups"])

    fresh, model2, opt2, state2, counter2 = manager(tmp_path)
    restored = fresh.resume(tmp_path)
    assert restored is not None and restored.path.name == "step_00000003"
    assert restored.rng is not None and restored.meta["step"] == 3
    assert (state2.step, state2.samples, state2.epoch_samples) == (3, 96, 96)
    assert all(torch.equal(saved[k], v) for k, v in model2.state_dict().items())
    assert json.dumps(opt2.state_dict()["param_groups"]) == saved_opt
    assert fresh.states["scheduler"].state_dict()["last_epoch"] == 3  # type: ignore[attr-defined]
    assert torch.equal(counter2.n, torch.ones(3))
    assert fresh.last_saved_step == 3


def test_a_checkpoint_that_does_not_load_falls_back_to_the_previous_one(tmp_path: Path) -> None:
    ckpt, model, opt, state, _ = manager(tmp_path)
    for _ in range(2):
        train(model, opt, ckpt.states["scheduler"], state, 1)
        ckpt.save("periodic")
    newest = committed(tmp_path)[-1]
    (newest / "rng_rank0.pt").write_bytes(b"not a pickle")  # the manifest check catches it
    fresh, *_ = manager(tmp_path)
    restored = fresh.resume(tmp_path)
    assert restored is not None and restored.path.name == "step_00000001"


def test_a_flipped_byte_of_the_same_size_fails_the_load_and_the_previous_checkpoint_is_restored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """verify=hash: the manager chooses by sizes, and the load's own xxh3_64 pass finds the flip:
    the restore falls back to the step before, with that step's weights."""
    ckpt, model, opt, state, _ = manager(tmp_path)
    train(model, opt, ckpt.states["scheduler"], state, 1)
    ckpt.save("periodic")
    first = {k: v.clone() for k, v in model.state_dict().items()}
    train(model, opt, ckpt.states["scheduler"], state, 1)
    ckpt.save("periodic")
    newest = committed(tmp_path)[-1]
    assert "xxh3_64" in json.loads((newest / "manifest.json").read_text())["files"][".metadata"]
    shard = next(newest.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    fresh, model2, *_ = manager(tmp_path)
    with caplog.at_level(logging.WARNING, logger="disttrain"):
        restored = fresh.resume(tmp_path)
    assert restored is not None and restored.path.name == "step_00000001"
    assert f"{shard.name} has the right size but the wrong xxh3_64" in caplog.text
    assert all(torch.equal(model2.state_dict()[k], v) for k, v in first.items())


def test_a_state_the_checkpoint_does_not_hold_keeps_its_value(tmp_path: Path) -> None:
    """A checkpoint saved with fewer states (an older one, a run without a scaler) restores into a
    manager that has more: the others keep their values."""
    ckpt, model, opt, state, _ = manager(tmp_path)
    train(model, opt, ckpt.states["scheduler"], state, 1)
    ckpt.states.pop("counter")
    ckpt.save("periodic")
    fresh, _, _, state2, counter2 = manager(tmp_path)
    counter2.n += 5
    assert fresh.resume(tmp_path) is not None
    assert state2.step == 1 and torch.equal(counter2.n, torch.full((3,), 5.0))


def test_no_checkpoint_there_is_none(tmp_path: Path) -> None:
    ckpt, *_ = manager(tmp_path)
    assert ckpt.resume(tmp_path) is None


@pytest.mark.parametrize(
    ("key", "value"),
    [("step", 30.5), ("step", 10**30), ("step", True), ("epoch", -1), ("samples", "x"), ("trackers", [1, 2])],
)
def test_a_crafted_meta_value_falls_back_to_the_previous_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, key: str, value: Any
) -> None:
    """Reliability D19: meta.json `step: 30.5` loaded, then step_name's {:08d} raised; 10**30
    overflowed. The manifest is rewritten to match, as a crafter would."""
    from disttrain.checkpoint.reading import file_digest

    ckpt, model, opt, state, _ = manager(tmp_path)
    for _ in range(2):
        train(model, opt, ckpt.states["scheduler"], state, 1)
        ckpt.save("periodic")
    newest = committed(tmp_path)[-1]
    meta = json.loads((newest / "meta.json").read_text())
    (newest / "meta.json").write_text(json.dumps({**meta, key: value}))
    manifest = json.loads((newest / "manifest.json").read_text())
    manifest["files"]["meta.json"] = file_digest(newest / "meta.json", "xxh3_64")
    (newest / "manifest.json").write_text(json.dumps(manifest))
    fresh, _, _, state2, _ = manager(tmp_path)
    with caplog.at_level(logging.WARNING, logger="disttrain"):
        restored = fresh.resume(tmp_path)
    assert restored is not None and restored.path.name == "step_00000001" and state2.step == 1
    assert f"meta.json has {key} " in caplog.text or f"meta.json has {key} of type" in caplog.text


class Position:
    """A per-rank state (a stream loader's position): not a tensor, different on every rank."""

    def __init__(self, at: int = 0) -> None:
        self.at = at

    def state_dict(self) -> dict[str, Any]:
        return {"at": self.at, "workers": [{"yielded": self.at}]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.at = state["at"]


def test_rank_states_go_into_the_ranks_file_and_come_back_at_the_same_dp_size(tmp_path: Path) -> None:
    ckpt, *_, state, _ = manager(tmp_path, rank_states={"loader": Position(17)})
    state.step = 3
    ckpt.save("periodic")
    back = Position()
    again, *_ = manager(tmp_path, rank_states={"loader": back})
    restored = again.resume(tmp_path)
    assert restored is not None and restored.rank_states == ["loader"] and back.at == 17
    assert "rank_states" not in (restored.rng or {})  # the RNG states alone are set later

    other = Position()
    resharded, *_ = manager(tmp_path, rank_states={"loader": other})
    resharded.run_info["dp_world_size"] = 2  # rank 0's position at 1 replica means nothing at 2
    restored = resharded.resume(tmp_path)
    assert restored is not None and restored.rank_states == [] and other.at == 0


def test_eval_restores_the_model_without_building_optimizer_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review G4: `disttrain eval`/`predict` restore the model (and EMA) only. Through a model +
    optimizer state dict torch would build AdamW's state (a zero gradient and a step: 2x the
    parameters' bytes) and read it from the checkpoint; nothing named exp_avg is requested now."""
    from disttrain import checkpoint
    from disttrain.eval_worker import restore

    ckpt, model, opt, state, _ = manager(tmp_path)
    train(model, opt, ckpt.states["scheduler"], state, 2)
    ckpt.save("periodic")
    requested: list[str] = []
    real_load = checkpoint.load_sharded

    def spy(path: Path, app: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict

        requested.extend(flatten_state_dict(app)[0])
        return real_load(path, app, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "load_sharded", spy)
    fresh, _, _ = parts()
    for p in fresh.parameters():
        p.data.zero_()
    where = restore(RUN, ENV, Strategy(SingleStrategyConfig(), ENV), fresh, tmp_path)
    assert where == (tmp_path / "step_00000002", 2)
    assert sorted(requested) == sorted(f"model.{k}" for k in model.state_dict())  # nothing else
    assert all(torch.equal(model.state_dict()[k], v) for k, v in fresh.state_dict().items())
    assert all(p.grad is None for p in fresh.parameters())  # torch's optimizer-state init sets zeros


def test_final_pt_holds_the_model_under_model_for_a_plain_load(tmp_path: Path) -> None:
    """Review F4: final.pt is {"model": state_dict, "step", "epoch"} (what the docs now say);
    its "model" entry loads into the plain model, strictly."""
    ckpt, model, opt, state, _ = manager(tmp_path)
    train(model, opt, ckpt.states["scheduler"], state, 2)
    ckpt.export_final(Strategy(SingleStrategyConfig(), ENV).model_state_dict(model))
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    assert (sorted(final), final["step"], final["epoch"]) == (["epoch", "model", "step"], 2, 0)
    plain, _, _ = parts()
    plain.load_state_dict(final["model"])  # strict
    assert all(torch.equal(model.state_dict()[k], v) for k, v in plain.state_dict().items())
