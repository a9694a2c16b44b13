"""The user's own code and configs: a model from the cwd, an experiment from --config-dir, and a
`${now:}` resolved once in the parent so that every rank reads the same frozen value."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from .conftest import QUICK, final_weights, read_yaml, run_cli, train_losses, train_records, write_module

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

NETS = '''\
import os
from pathlib import Path

from torch import nn


class Net(nn.Module):
    """A user model with its own width argument; each rank records the `stamp` it was built with."""

    def __init__(self, in_features: int, num_classes: int, width: int, stamp: str = "") -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(in_features, width), nn.Tanh(), nn.Linear(width, num_classes))
        rank = os.environ.get("RANK")
        if rank is not None:  # a training rank, not the parent's meta-device check
            out = Path("seen") / f"rank{rank}.txt"
            out.parent.mkdir(exist_ok=True)
            out.write_text(stamp)

    def forward(self, x):
        return self.body(x)
'''

PAPER = """\
# @package _global_
# The user's experiment, committed next to their paper: only what changes.
defaults:
  - override /data: synthetic
  - override /optim: sgd
  - override /sched: constant

name: paper
optim:
  lr: 0.0123
trainer:
  max_steps: 4
  batch_size: 8
  log_every: 2
"""


@pytest.mark.parametrize("launcher", ["torchrun", "spawn"])
def test_model_from_cwd_and_now_frozen_once(tmp_path: Path, launcher: str) -> None:
    write_module(tmp_path, "mylab.nets", NETS)
    _, run_dir = run_cli(
        tmp_path,
        f"launcher={launcher}",
        *QUICK,
        "model._target_=mylab.nets.Net",  # a clean node: no mlp keys, no `+` needed
        "model.in_features=${data.num_features}",
        "model.num_classes=${data.num_classes}",
        "model.width=16",
        "model.stamp=${now:%H-%M-%S-%f}",
    )
    assert run_dir is not None
    weights = final_weights(run_dir)
    assert {k: tuple(v.shape) for k, v in weights.items()} == {
        "body.0.weight": (16, 32),
        "body.0.bias": (16,),
        "body.2.weight": (4, 16),
        "body.2.bias": (4,),
    }
    losses = train_losses(run_dir)
    assert len(losses) == 6 and losses[-1] < losses[0]

    cfg = read_yaml(run_dir / "config.yaml")
    stamp = cfg["model"]["stamp"]
    assert re.fullmatch(r"\d\d-\d\d-\d\d-\d{6}", stamp), stamp
    seen = {p.name: p.read_text() for p in (tmp_path / "seen").iterdir()}
    assert seen == {"rank0.txt": stamp, "rank1.txt": stamp}, "each rank must read the parent's frozen value"


def test_experiment_from_config_dir(tmp_path: Path) -> None:
    (tmp_path / "myconf" / "experiment").mkdir(parents=True)
    (tmp_path / "myconf" / "experiment" / "paper.yaml").write_text(PAPER)
    _, run_dir = run_cli(tmp_path, "experiment=paper", flags=["--config-dir", "myconf"])
    assert run_dir is not None
    assert run_dir.parent == tmp_path / "runs" / "paper", run_dir  # name=paper names the run dir

    cfg = read_yaml(run_dir / "config.yaml")
    assert cfg["name"] == "paper" and cfg["data"]["name"] == "synthetic"
    assert cfg["optim"]["_target_"] == "torch.optim.SGD" and cfg["optim"]["lr"] == 0.0123
    assert cfg["sched"]["name"] == "constant"
    # The experiment wins over the primary config's own trainer values (log_every: 10 there).
    assert cfg["trainer"]["max_steps"] == 4 and cfg["trainer"]["batch_size"] == 8
    assert cfg["trainer"]["log_every"] == 2

    summary = read_yaml(run_dir / "summary.json")
    assert summary["steps"] == 4 and summary["samples"] == 4 * 8 * 2  # 2 ranks x batch 8
    train = train_records(run_dir)
    assert [(r["step"], r["lr"]) for r in train] == [(2, 0.0123), (4, 0.0123)]


GROUPS = """
def freeze_positions(model):
    # A user's grouping: the position embedding gets lr 0 (so it must not move), the rest trains.
    pos = [p for n, p in model.named_parameters() if n.endswith("embed.pos.weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("embed.pos.weight")]
    return [{"params": rest}, {"params": pos, "lr": 0.0}]
"""


def test_user_param_groups_and_a_torch_scheduler_under_zero(tmp_path: Path) -> None:
    """The factory gets the DDP-wrapped model, ZeRO rebuilds its groups, StepLR steps per step."""
    import torch

    from disttrain.models import build_model

    write_module(tmp_path, "mylab.groups", GROUPS)
    model_keys = ("model=gpt", "model.dim=16", "model.n_layers=1")
    _, run_dir = run_cli(
        tmp_path, *model_keys, "strategy=zero", "trainer.max_steps=4", "trainer.log_every=1",
        "trainer.batch_size=8", "optim.lr=0.01", "optim.param_groups._target_=mylab.groups.freeze_positions",
        "sched._target_=torch.optim.lr_scheduler.StepLR", "sched.step_size=2", "sched.gamma=0.5",
    )  # fmt: skip
    assert run_dir is not None
    assert [r["lr"] for r in train_records(run_dir)] == pytest.approx([0.01, 0.01, 0.005, 0.005])
    cfg = read_yaml(run_dir / "config.yaml")
    torch.manual_seed(cfg["seed"])  # the worker's init: same seed, same model
    init = build_model(cfg["model"]).state_dict()
    final = final_weights(run_dir)
    assert torch.equal(final["embed.pos.weight"], init["embed.pos.weight"]), "lr 0 group moved"
    assert not torch.equal(final["embed.tok.weight"], init["embed.tok.weight"]), "the rest trains"
