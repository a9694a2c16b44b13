"""`disttrain eval` / `predict` (issue 26 item 1): the user's mistakes are one paragraph before any
rank starts and before anything is written; the prediction writer keeps dataset order and row
counts in every format; an eval job folder is not listed as a run. The runs themselves (fsdp at
world size 1 and 2, predict on an odd set) are in tests/integration/test_strategies_dp.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from unit_support import checked, disttrain_in_process

from disttrain.eval_worker import predict, write_predictions
from disttrain.rundir import RunDir


@pytest.fixture(scope="module")
def saved() -> dict:
    return checked(["data=synthetic", "trainer.max_steps=30"])


def _run(root: Path, cfg: dict, ckpt: bool = True) -> Path:
    from disttrain.trust import sign

    run = root / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    sign(run)  # this user's own run
    if ckpt:
        (run / "checkpoints" / "step_00000030").mkdir(parents=True)
    return run


def _paragraph(proc: object) -> str:
    assert proc.returncode == 2, proc.stderr  # type: ignore[attr-defined]
    err: str = proc.stderr  # type: ignore[attr-defined]
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_predict_without_out_names_the_flag(saved: dict, tmp_path: Path) -> None:
    run = _run(tmp_path, saved)
    err = _paragraph(disttrain_in_process("predict", str(run), cwd=tmp_path))
    assert "--out" in err and ".jsonl" in err
    assert not (run / "evals").exists()


def test_a_missing_validation_file_names_the_key(saved: dict, tmp_path: Path) -> None:
    run = _run(tmp_path, saved)
    err = _paragraph(disttrain_in_process("eval", str(run), "data.val=nope.npz", cwd=tmp_path))
    assert "data.val" in err and "nope.npz" in err and ".npz" in err
    assert not (run / "evals").exists() and not (run / "eval.json").exists()


def test_a_run_without_validation_set_says_how_to_name_one(saved: dict, tmp_path: Path) -> None:
    cfg = json.loads(json.dumps(saved))
    cfg["data"]["val"] = None
    run = _run(tmp_path, cfg)
    err = _paragraph(disttrain_in_process("eval", str(run), cwd=tmp_path))
    assert "data.val" in err and "data.val=val.npz" in err


def test_a_run_without_checkpoint_is_refused(saved: dict, tmp_path: Path) -> None:
    run = _run(tmp_path, saved, ckpt=False)
    err = _paragraph(disttrain_in_process("eval", str(run), cwd=tmp_path))
    assert "no checkpoint under" in err


def test_someone_elses_run_with_user_code_needs_trust(saved: dict, tmp_path: Path) -> None:
    cfg = json.loads(json.dumps(saved))
    cfg["model"]["_target_"] = "mylab.nets.Net"
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))  # not signed: not ours
    (run / "checkpoints" / "step_00000030").mkdir(parents=True)
    err = _paragraph(disttrain_in_process("eval", str(run), cwd=tmp_path))
    assert "--trust" in err and "mylab.nets.Net" in err


def test_pipeline_predict_asks_for_another_strategy(saved: dict, tmp_path: Path) -> None:
    run = _run(tmp_path, saved)
    out = tmp_path / "p.jsonl"
    err = _paragraph(
        disttrain_in_process("predict", str(run), "--out", str(out), "strategy=pipeline", cwd=tmp_path)
    )
    assert "strategy" in err and "strategy=fsdp" in err
    assert not out.exists()


def test_help_is_a_page(tmp_path: Path) -> None:
    for command in ("eval", "predict"):
        proc = disttrain_in_process(command, "--help", cwd=tmp_path)
        assert proc.returncode == 0 and proc.stdout.startswith(f"usage: disttrain {command} RUN_DIR")
    assert "eval" in disttrain_in_process("--help", cwd=tmp_path).stdout


def test_an_eval_job_folder_is_not_a_run(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text("seed: 0\n")
    assert RunDir(tmp_path).is_run()
    (tmp_path / "job.json").write_text('{"mode": "eval"}')
    assert not RunDir(tmp_path).is_run()


ROWS = [(i, torch.tensor([float(i), -float(i)])) for i in range(5)]


@pytest.mark.parametrize("suffix", [".jsonl", ".pt", ".npy"])
def test_predictions_keep_order_and_count_in_every_format(tmp_path: Path, suffix: str) -> None:
    out = tmp_path / f"preds{suffix}"
    write_predictions(ROWS, out)
    want = torch.stack([row for _, row in ROWS])
    if suffix == ".jsonl":
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        assert [r["index"] for r in rows] == list(range(5))
        assert torch.equal(torch.tensor([r["output"] for r in rows]), want)
    elif suffix == ".pt":
        assert torch.equal(torch.load(out, weights_only=True), want)
    else:
        assert np.array_equal(np.load(out), want.numpy())


@pytest.mark.parametrize("suffix", [".jsonl", ".npy"])
def test_a_large_prediction_file_is_announced_with_its_size_before_it_is_written(
    tmp_path: Path, suffix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review 2026-11-28-ux #15: `predict` wrote 242 MB of JSON logits without a word."""
    import logging

    from disttrain import eval_worker

    out = tmp_path / f"preds{suffix}"
    said: list[tuple[str, bool]] = []

    class Seen(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append((record.getMessage(), out.exists()))

    monkeypatch.setattr(eval_worker, "LARGE_OUTPUT", 4096)
    handler = Seen(logging.WARNING)
    eval_worker.log.addHandler(handler)
    try:
        write_predictions(ROWS, tmp_path / "small.jsonl")  # under the threshold: silent
        rows = [(i, torch.full((64,), 0.123456789)) for i in range(100)]  # 100 rows of 64 logits
        write_predictions(rows, out)
    finally:
        eval_worker.log.removeHandler(handler)
    ((message, existed),) = said
    assert not existed, "announced before the file is written"
    size = out.stat().st_size
    assert message.startswith(f"predict: writing {size / 2**10:,.1f} KiB to {out} (100 rows, ")
    if suffix == ".jsonl":  # the binary form is named, with its size: 100 x 64 float32
        assert "smaller: --out preds.npy (or .pt) holds the same numbers in binary: about 25.0 KiB" in message
    else:
        assert "smaller: fewer samples: data.val=FILE with a subset" in message
    assert "a Task.predict that returns only what you need" in message


def test_a_task_predict_hook_and_dict_outputs(tmp_path: Path) -> None:
    """One rank, a shard of 5 samples in batches of 2: the hook's dict comes back per sample."""
    from torch.utils.data import DataLoader, TensorDataset

    from disttrain.config.schema import StrategyConfig
    from disttrain.data.samplers import ShardSampler
    from disttrain.dist import DistEnv
    from disttrain.strategies.base import Strategy
    from disttrain.tasks import Classification

    class Hooked(Classification):
        def predict(self, model: torch.nn.Module, batch: object) -> dict[str, torch.Tensor]:
            x, _ = batch  # type: ignore[misc]
            logits = model(x)
            return {"label": logits.argmax(-1), "score": logits.max(-1).values}

    data = TensorDataset(torch.arange(10.0).reshape(5, 2), torch.zeros(5, dtype=torch.long))
    loader = DataLoader(data, batch_size=2, sampler=ShardSampler(5, 0, 1))
    model = torch.nn.Linear(2, 3)
    env = DistEnv(
        rank=0, local_rank=0, world_size=1, local_world_size=1, backend="gloo", device=torch.device("cpu")
    )
    strategy = Strategy(StrategyConfig(name="single"), env)
    rows = predict(strategy, model, Hooked(), loader, env)
    assert [i for i, _ in rows] == list(range(5))
    with torch.no_grad():
        logits = model(data.tensors[0])
    assert [int(r["label"]) for _, r in rows] == logits.argmax(-1).tolist()
    out = tmp_path / "p.jsonl"
    write_predictions(rows, out)
    first = json.loads(out.read_text().splitlines()[0])
    assert set(first) == {"index", "label", "score"}


@pytest.mark.usefixtures("one_rank")
def test_eval_and_predict_loop_with_the_setup_objects_frozen_and_give_them_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As training (issue 34): a rank's first full garbage collection in the loop scanned the whole
    setup heap at a batch of its own while its peers waited in the next collective forward. The
    loops run with the setup's objects frozen (`gc.freeze`), unfrozen after them."""
    import gc

    from disttrain import eval_worker
    from disttrain.config.run import Run
    from disttrain.dist import DistEnv

    run = Run.of(checked(["data=synthetic", "data.num_val_samples=8", "threads_per_rank=1"]))
    env = DistEnv(0, 0, 1, 1, "gloo", torch.device("cpu"))
    frozen: list[int] = []

    def counting(result: object) -> object:
        def loop(*args: object, **kwargs: object) -> object:
            frozen.append(gc.get_freeze_count())
            return result

        return loop

    monkeypatch.setattr(eval_worker, "restore", lambda *args, **kwargs: (tmp_path, 30))
    monkeypatch.setattr(eval_worker, "validation", counting({"val/loss": 1.0}))
    monkeypatch.setattr(eval_worker, "predict", counting([]))
    before = gc.get_freeze_count()
    for mode in ("eval", "predict"):
        job = {"mode": mode, "checkpoint": str(tmp_path), "out": str(tmp_path / f"{mode}.jsonl")}
        eval_worker.evaluate(run, env, job)
    assert len(frozen) == 2 and min(frozen) > before + 1000, (before, frozen)  # torch's objects at least
    assert gc.get_freeze_count() == before == 0


def test_a_batch_level_loss_beside_per_sample_outputs_is_dropped() -> None:
    """`model_loss` models return (logits, loss): predict keeps the logits, one row per sample."""
    from disttrain.eval_worker import _per_sample

    logits, loss = torch.randn(4, 3), torch.tensor(0.5)
    assert torch.equal(_per_sample((logits, loss), 4), logits)
    assert set(_per_sample({"logits": logits, "loss": loss}, 4)) == {"logits"}
    with pytest.raises(TypeError, match="predict\\(model, batch\\)"):
        _per_sample(loss, 4)


def test_a_cache_object_in_a_dict_output_is_dropped_with_one_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Review F3: a Hugging Face causal LM returns CausalLMOutputWithPast (a dict) whose
    past_key_values is a cache object: predict keeps the logits, drops the cache and says so once."""
    import logging
    from collections import OrderedDict

    from torch.utils.data import DataLoader, TensorDataset

    from disttrain.config.schema import StrategyConfig
    from disttrain.data.samplers import ShardSampler
    from disttrain.dist import DistEnv
    from disttrain.strategies.base import Strategy
    from disttrain.tasks import Classification

    class DynamicCache:  # what HF puts beside the logits
        pass

    class CausalLM(torch.nn.Linear):
        def forward(self, x: torch.Tensor) -> OrderedDict:  # type: ignore[override]
            logits = super().forward(x)
            return OrderedDict(loss=logits.mean(), logits=logits, past_key_values=DynamicCache())

    data = TensorDataset(torch.arange(10.0).reshape(5, 2), torch.zeros(5, dtype=torch.long))
    loader = DataLoader(data, batch_size=2, sampler=ShardSampler(5, 0, 1))
    model = CausalLM(2, 3)
    env = DistEnv(0, 0, 1, 1, "gloo", torch.device("cpu"))
    with caplog.at_level(logging.INFO, logger="disttrain"):
        rows = predict(Strategy(StrategyConfig(name="single"), env), model, Classification(), loader, env)
    with torch.no_grad():
        logits = torch.nn.functional.linear(data.tensors[0], model.weight, model.bias)
    assert [set(r) for _, r in rows] == [{"logits"}] * 5
    assert torch.allclose(torch.stack([r["logits"] for _, r in rows]), logits)
    said = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert said == [
        "predict: dropped what the model's dict output holds besides tensors: past_key_values (DynamicCache)"
    ]
