"""Early stopping and best checkpoints (issue 26 item 3), on a run whose numbers are known ahead.

The model is one scalar w = 1; training's loss is w itself (gradient 1), so plain SGD at lr 0.1
walks w down by exactly 0.1 a step: w_t = 1 - 0.1 t. Validation's loss is (w - 0.5)^2: 0.16,
0.09, 0.04, 0.01, ~0, 0.01, 0.04, ... at steps 1, 2, 3, ...: lowest at step 5, rising after. With
a validation every step and patience 2, steps 6 and 7 do not improve: the run stops at step 7,
and `checkpoints/best` names step 5 (kept although keep=1 would prune it).
"""

from __future__ import annotations

import copy
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from unit_support import checked, write_module

from disttrain.checkpoint import read_meta
from disttrain.config.errors import ConfigError
from disttrain.config.run import Run
from disttrain.dist import DistEnv
from disttrain.observe.metrics import read_metrics
from disttrain.worker import train

SCALAR = """
import torch
from torch import nn


class Scalar(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor(1.0))

    def forward(self, x):
        return self.w.expand(x.shape[0])


def step(model, batch):
    x, _ = batch
    w = model(x).mean()
    return w if model.training else (w - 0.5) ** 2
"""

RUN = (
    "nproc_per_node=1", "trainer.progress=false", "threads_per_rank=1", "observe.sinks=[]",
    "data=synthetic", "data.num_samples=64", "data.num_val_samples=8", "trainer.batch_size=8",
    "model._target_=eslab.Scalar", "task._target_=eslab.step",
    "optim=sgd", "optim.lr=0.1", "optim.momentum=0", "optim.weight_decay=0", "sched=constant",
    "trainer.clip_grad_norm=null", "trainer.max_steps=30", "trainer.val_every=1", "trainer.log_every=1",
    "checkpoint.export_final=false",
)  # fmt: skip


@pytest.fixture(autouse=True)
def user_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_rank: None) -> Iterator[None]:
    monkeypatch.syspath_prepend(str(tmp_path))
    write_module(tmp_path, "eslab", SCALAR)
    try:
        yield
    finally:
        sys.modules.pop("eslab", None)


def run(run_dir: Path, *overrides: str) -> dict[str, Any]:
    cfg = checked([*RUN, *overrides])
    run_dir.mkdir(parents=True, exist_ok=True)
    return train(Run.of(cfg), DistEnv(0, 0, 1, 1, "gloo", torch.device("cpu")), run_dir)


def val_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["val/loss"] for r in read_metrics(run_dir) if "val/loss" in r}


def test_patience_2_stops_at_the_predicted_step_and_best_holds_the_lowest(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    summary = run(run_dir, "trainer.early_stop.patience=2", "checkpoint.keep_best=1", "checkpoint.keep=1")
    losses = val_losses(run_dir)
    assert sorted(losses) == list(range(1, 8)), "validations at steps 1..7, then the stop"
    for step, loss in losses.items():
        assert loss == pytest.approx((0.5 - 0.1 * step) ** 2, abs=1e-6), step
    assert summary["steps"] == 7 and summary["early_stopped"] is True
    assert "val/loss did not improve" in summary["stop_reason"] and "(step 5)" in summary["stop_reason"]
    assert summary["best_step"] == 5 and summary["best/val/loss"] == pytest.approx(0.0, abs=1e-12)
    saved = json.loads((run_dir / "summary.json").read_text())
    assert saved["early_stopped"] is True and saved["stop_reason"] == summary["stop_reason"]
    ckpts = run_dir / "checkpoints"
    best = (ckpts / "best").read_text().strip()
    assert best == "step_00000005"
    assert read_meta(ckpts / best)["last_val"]["val/loss"] == min(losses.values())
    # keep=1 kept the newest (the final one at step 7) and the best; the rest were pruned
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_00000005", "step_00000007"]


def test_resuming_an_early_stopped_run_trains_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run(run_dir, "trainer.early_stop.patience=2")
    again = run(run_dir, "trainer.early_stop.patience=2", "resume=auto")
    assert again["steps"] == 7 and again["early_stopped"] is True
    assert max(val_losses(run_dir)) == 7


def test_max_mode_and_min_delta(tmp_path: Path) -> None:
    """mode=max on the loss (it "improves" while rising after step 5) never stops before step 5's
    decline ends; min_delta=0.02 makes step 4 -> 5 (0.01 -> 0) no improvement, so patience 1 stops
    at step 5 in min mode."""
    summary = run(tmp_path / "a", "trainer.early_stop.patience=1", "trainer.early_stop.min_delta=0.02")
    assert summary["steps"] == 5 and "(step 4)" in summary["stop_reason"]
    summary = run(tmp_path / "b", "trainer.early_stop.patience=1", "trainer.early_stop.mode=max")
    assert summary["steps"] == 2  # step 2 (0.09) is below step 1 (0.16): no improvement in max mode


@pytest.fixture(scope="module")
def watched() -> dict[str, Any]:
    """A composed, checked config with early stopping on (composed once: ~1 s each)."""
    return checked(["data=synthetic", "trainer.early_stop.patience=2", "checkpoint.keep_best=1"])


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("trainer.early_stop.mode", "lowest"),
        ("trainer.early_stop.patience", -1),
        ("trainer.early_stop.min_delta", -0.1),
        ("checkpoint.keep_best", -2),
        ("checkpoint.mode", "up"),
        ("trainer.early_stop.monitor", "train/loss"),
        ("checkpoint.monitor", "loss"),
        ("data.val", None),
    ],
)
def test_settings_are_checked_before_launch(watched: dict[str, Any], key: str, value: Any) -> None:
    from disttrain.config.run import Run
    from disttrain.preflight.checks import check_static

    cfg = copy.deepcopy(watched)
    parent, _, leaf = key.rpartition(".")
    node = cfg
    for part in parent.split("."):
        node = node[part]
    node[leaf] = value
    with pytest.raises(ConfigError) as info:
        check_static(Run.of(cfg))
    if key == "data.val":  # early stopping without a validation set: named by the setting that needs one
        assert info.value.key == "trainer.early_stop.patience" and "data.val" in str(info.value)
    else:
        assert info.value.key == key


def test_a_metric_the_task_does_not_report_names_the_ones_it_does(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        run(tmp_path / "run", "trainer.early_stop.patience=2", "trainer.early_stop.monitor=val/acc")
    assert info.value.key == "trainer.early_stop.monitor" and "val/loss" in str(info.value)
