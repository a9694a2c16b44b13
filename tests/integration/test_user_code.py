"""The user's own code and configs: a model from the cwd, an experiment from --config-dir, and a
`${now:}` resolved once in the parent so that every rank reads the same frozen value.

The runs from the user's folder (the model under torchrun and spawn, the param groups under zero,
its Hugging Face data under ddp and fsdp, map-style and streamed) are the jobs of one
`disttrain train -m` sweep in that folder (tests/integration/sweep.py: one start-up for all, each
job a complete run with its own run dir); the experiment, whose name names its run dir, is a run of
its own."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from .conftest import QUICK, final_weights, read_yaml, run_cli, train_losses, train_records, write_module
from .sweep import Sweep, run_sweep

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]  # the sweep: 6 jobs

NETS = '''\
import os
from pathlib import Path

from torch import nn


class Net(nn.Module):
    """A user model with its own width argument; each rank records the `stamp` it was built with
    (in a folder named after it: the runs of one sweep share the cwd)."""

    def __init__(self, in_features: int, num_classes: int, width: int, stamp: str = "") -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(in_features, width), nn.Tanh(), nn.Linear(width, num_classes))
        rank = os.environ.get("RANK")
        if rank is not None:  # a training rank, not the parent's meta-device check
            out = Path("seen") / stamp / f"rank{rank}.txt"
            out.parent.mkdir(parents=True, exist_ok=True)
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


GROUPS = """
def freeze_positions(model):
    # A user's grouping: the position embedding gets lr 0 (so it must not move), the rest trains.
    pos = [p for n, p in model.named_parameters() if n.endswith("embed.pos.weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("embed.pos.weight")]
    return [{"params": rest}, {"params": pos, "lr": 0.0}]
"""

USER_NET = (
    *QUICK,
    "model._target_=mylab.nets.Net",  # a clean node: no mlp keys, no `+` needed
    "model.in_features=${data.num_features}",
    "model.num_classes=${data.num_classes}",
    "model.width=16",
    "model.stamp=${now:%H-%M-%S-%f}",
)
ZERO = ("model=gpt", "model.dim=16", "model.n_layers=1", "strategy=zero", "trainer.max_steps=4",
        "trainer.log_every=1", "trainer.batch_size=8", "optim.lr=0.01",
        "optim.param_groups._target_=mylab.groups.freeze_positions",
        "sched._target_=torch.optim.lr_scheduler.StepLR", "sched.step_size=2", "sched.gamma=0.5")  # fmt: skip
# data=hf (issue 24 item 4): the user's Hugging Face data, a saved folder and JSON lines, under ddp and
# fsdp, and streamed under ddp (a data=mix run: tests/unit/test_data_mix.py, one rank in process).
# Rows are sequences (s, s+d, s+2d, ...) mod 32: a 1-block GPT learns them fast.
HF_LM = ("model=gpt", "model.dim=32", "model.n_layers=1", "data.num_features=16", "data.num_classes=32",
         "task.inputs=input_ids", "task.target=labels", "trainer.max_steps=30", "trainer.batch_size=8",
         "trainer.log_every=5", "optim.lr=0.01")  # fmt: skip
RUNS = {
    "net-torchrun": ("launcher=torchrun", *USER_NET),
    "net-spawn": ("launcher=spawn", *USER_NET),
    "groups-zero": ZERO,
    "hf-saved-ddp": ("data=hf", "data.path=saved", "data.split='train[:90%]'", "data.val_split='train[90%:]'",
                     *HF_LM),
    "hf-jsonl-fsdp": ("data=hf", "data.path=seqs.jsonl", "data.columns=[input_ids,labels]", "strategy=fsdp",
                      *HF_LM),
    "hf-stream-ddp": ("data=hf", "data.path=seqs.jsonl", "data.columns=[input_ids,labels]",
                      "data.streaming=true", *HF_LM),
}  # fmt: skip


def write_sequences(cwd: Path, rows: int = 256, length: int = 17, vocab: int = 32) -> None:
    """`saved/` (Dataset.save_to_disk) and `seqs.jsonl`: input_ids and labels (shifted by one)."""
    import json
    import random

    from datasets import Dataset

    rng = random.Random(0)
    data = []
    for _ in range(rows):
        start, step = rng.randrange(vocab), rng.randrange(1, 4)
        seq = [(start + step * k) % vocab for k in range(length)]
        data.append({"input_ids": seq[:-1], "labels": seq[1:], "text": "a string column"})
    Dataset.from_list(data).save_to_disk(str(cwd / "saved"))
    (cwd / "seqs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in data))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Sweep:
    """Every run of RUNS as a job of one sweep in one user folder holding the user's package."""
    cwd = tmp_path_factory.mktemp("user_code")
    write_module(cwd, "mylab.nets", NETS)
    write_module(cwd, "mylab.groups", GROUPS)
    write_sequences(cwd)
    with pytest.MonkeyPatch.context() as env:  # the ranks' Arrow cache of the JSON lines: in cwd
        env.setenv("HF_DATASETS_CACHE", str(cwd / "hf_cache"))
        return run_sweep(cwd, RUNS)


@pytest.mark.parametrize("launcher", ["torchrun", "spawn"])
def test_model_from_cwd_and_now_frozen_once(runs: Sweep, launcher: str) -> None:
    run_dir = runs[f"net-{launcher}"]
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
    seen = {p.name: p.read_text() for p in (runs.cwd / "seen" / stamp).iterdir()}
    assert seen == {"rank0.txt": stamp, "rank1.txt": stamp}, "each rank must read the parent's frozen value"
    # No rank resolved `${now:}` itself: the only stamps are the two runs' frozen ones.
    frozen = {
        read_yaml(runs[f"net-{name}"] / "config.yaml")["model"]["stamp"] for name in ("torchrun", "spawn")
    }
    assert {p.name for p in (runs.cwd / "seen").iterdir()} == frozen and len(frozen) == 2


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


def test_user_param_groups_and_a_torch_scheduler_under_zero(runs: Sweep) -> None:
    """The factory gets the DDP-wrapped model, ZeRO rebuilds its groups, StepLR steps per step."""
    import torch

    from disttrain.models import build_model

    run_dir = runs["groups-zero"]
    assert [r["lr"] for r in train_records(run_dir)] == pytest.approx([0.01, 0.01, 0.005, 0.005])
    cfg = read_yaml(run_dir / "config.yaml")
    torch.manual_seed(cfg["seed"])  # the worker's init: same seed, same model
    init = build_model(cfg["model"]).state_dict()
    final = final_weights(run_dir)
    assert torch.equal(final["embed.pos.weight"], init["embed.pos.weight"]), "lr 0 group moved"
    assert not torch.equal(final["embed.tok.weight"], init["embed.tok.weight"]), "the rest trains"


@pytest.mark.parametrize("run", ["hf-saved-ddp", "hf-jsonl-fsdp", "hf-stream-ddp"])
def test_hugging_face_data_trains_under_ddp_and_fsdp(runs: Sweep, run: str) -> None:
    """dict rows from a saved folder / JSON lines, map-style or streamed (each rank its half of the
    rows, 16 batches, read again after), reach the task as fields; the loss falls."""
    run_dir = runs[run]
    losses = train_losses(run_dir)
    assert len(losses) == 6 and losses[-1] < 0.6 * losses[0], losses
    summary = read_yaml(run_dir / "summary.json")
    assert summary["samples"] == 30 * 8 * 2
    if run == "hf-saved-ddp":  # validation on the held-out slice: 26 rows, learned as well
        assert summary["val/loss"] < 0.6 * losses[0]
