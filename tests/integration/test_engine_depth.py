"""Engine depth through the real CLI on 2 gloo CPU ranks, where ranks must agree: fp16 loss scaling
under fsdp, NaN on one rank, the parameter-sync check, gpt under fsdp and fsdp+tp, tp with dropout,
uneven validation shards; and compile (1 rank). The runs that succeed are the jobs of one `disttrain train
-m` sweep (tests/integration/sweep.py: one start-up for all, each job a complete run with its own
run dir); the two that must fail are runs of their own.
What one rank shows (bf16 gpt, fp16 under ddp, FSDP's bf16 policy, activation checkpointing,
out-of-memory halving with the profiler and grad stats, and its give-up) runs in-process:
tests/unit/test_engine_depth.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from shared_support import TINY_GPT, check_one_fp16_overflow

from disttrain.checkpoint import read_meta
from disttrain.testing import FAULT_MLP

from .conftest import run_cli, train_in_process, train_losses, train_records, val_records, write_module
from .sweep import Sweep, run_sweep

pytestmark = [pytest.mark.slow, pytest.mark.timeout(750)]  # the sweep: 8 x JOB_BUDGET

FAULT = ("data=synthetic", *FAULT_MLP, "trainer.log_every=1")
# trainer.val_batches: data=text's validation split is ~1,450 windows of 32 (~45 batches of 16 a
# rank, each validation); 2 batches a rank are the first 64 windows in every layout (ShardSampler:
# every 2nd window a rank under fsdp; single's and fsdp+tp's first 2 batches of 32), so the
# weighted results still compare
GPT = (*TINY_GPT, "trainer.batch_size=16", "trainer.max_steps=6", "trainer.val_every=3",
       "trainer.log_every=1", "trainer.clip_grad_norm=0.5", "backend.timeout=60",
       "trainer.val_batches=2")  # fmt: skip
GPT_RUNS = {
    "single": ("strategy=single", "nproc_per_node=1", "trainer.batch_size=32"),
    "fsdp": ("strategy=fsdp", "strategy.min_num_params=1000"),
    "fsdp+tp": ("strategy=fsdp+tp", "trainer.batch_size=32"),
}
# tp with dropout (issue 27): a GPT of the test's own (tpdump.DumpGPT, written into the sweep's
# folder) saves each rank's replicated parameters at every validation forward, so the test compares
# them across the two tp ranks after the last step (one validation batch: one dump, not one a batch).
TP_DROPOUT = ("model=gpt", "data=text", "model._target_=tpdump.DumpGPT", "model.vocab_size=${data.num_classes}",
              "model.block_size=${data.num_features}", "model.dim=32", "model.n_layers=1", "model.n_heads=2",
              "data.block_size=32", "model.dropout=0.1", "model.dump_dir=tp_dumps", "strategy=tp",
              "trainer.batch_size=16", "trainer.max_steps=20", "trainer.val_every=20", "trainer.log_every=1",
              "backend.timeout=60", "trainer.val_batches=1")  # fmt: skip
DUMP_GPT = """
import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from disttrain.models.gpt import GPT, gpt_tp_plan


class DumpGPT(GPT):
    def __init__(self, *args, dump_dir="", **kwargs):
        super().__init__(*args, **kwargs)
        self.dump_dir = dump_dir

    def tp_plan(self):
        return gpt_tp_plan(self)

    def forward(self, idx):
        if not self.training and dist.is_initialized():  # validation: after the step's update
            mine = {}
            for name, p in self.named_parameters():
                if not isinstance(p, DTensor):
                    mine[name] = p.detach().clone()
                elif all(isinstance(pl, Replicate) for pl in p.placements):
                    mine[name] = p.to_local().detach().clone()
            os.makedirs(self.dump_dir, exist_ok=True)
            torch.save(mine, os.path.join(self.dump_dir, f"rank{dist.get_rank()}.pt"))
        return super().forward(idx)
"""
UNEVEN = ("data=synthetic", "data.num_val_samples=9", "trainer.max_steps=4", "trainer.val_every=2",
          "backend.timeout=30")  # fmt: skip
# trainer.ema under fsdp on 2 ranks (each holds half of every EMA weight) against torch's AveragedModel
# EMA of one process with the same global batch (32).
EMA = ("data=synthetic", "model.hidden=[32,32]", "trainer.max_steps=20", "trainer.val_every=10",
       "trainer.ema.decay=0.9", "backend.timeout=60")  # fmt: skip
# The runs that succeed and need no other run: the jobs of one sweep (name -> overrides). The runs
# that must fail (NaN stop, sync check) stay runs of their own: a failed job ends a sweep.
RUNS = {
    "fp16_overflow": (*FAULT, "strategy=fsdp", "amp=fp16", "+model.inf_grad_at=3", "trainer.max_steps=12",
                      "trainer.ckpt_every=6"),
    "nan_skip": (*FAULT, "+model.nan_at=5", "+model.nan_rank=1", "trainer.detect_anomaly=skip",
                 "trainer.max_steps=8"),
    "compile": ("data=synthetic", "strategy=single", "nproc_per_node=1", "trainer.compile=true",
                "trainer.max_steps=3", "model.hidden=[16]", "trainer.log_every=1"),
    "gpt-fsdp": (*GPT, *GPT_RUNS["fsdp"]),
    "gpt-fsdp+tp": (*GPT, *GPT_RUNS["fsdp+tp"]),
    "gpt-tp-dropout": TP_DROPOUT,
    "uneven_val": (*UNEVEN, "strategy=fsdp", "strategy.min_num_params=100", "trainer.batch_size=4"),
    "ema-fsdp": (*EMA, "strategy=fsdp", "strategy.min_num_params=100", "trainer.batch_size=16"),
}  # fmt: skip
JOB_BUDGET = 90  # compile's first step compiles


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Sweep:
    """Every run of RUNS as the jobs of one sweep (one parent process and fork server for all)."""
    cwd = tmp_path_factory.mktemp("sweep")
    write_module(cwd, "tpdump", DUMP_GPT)
    return run_sweep(cwd, RUNS, budget=JOB_BUDGET)


def test_fp16_overflow_under_fsdp_skips_that_step_and_lowers_the_scale(runs: Sweep) -> None:
    """Every rank overflows at step 3: the sharded scaler skips that step on every shard."""
    run_dir = runs["fp16_overflow"]
    check_one_fp16_overflow(train_records(run_dir))
    meta = read_meta(run_dir / "checkpoints" / "step_00000012")
    assert meta["has_scaler"] is True


def test_nan_loss_stops_naming_step_rank_and_last_good_checkpoint(tmp_path: Path) -> None:
    proc, run_dir = run_cli(
        tmp_path, *FAULT, "+model.nan_at=5", "+model.nan_rank=1", "trainer.detect_anomaly=stop",
        "trainer.ckpt_every=2", "trainer.max_steps=10", expect_rc=1,
    )  # fmt: skip
    assert run_dir is not None
    out = proc.stdout + proc.stderr
    ckpts = run_dir / "checkpoints"
    assert "non-finite loss on rank(s) [1] at step 5" in out
    assert f"Last good checkpoint: {ckpts / 'step_00000004'}" in out
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_00000002", "step_00000004"]
    assert not list(ckpts.glob(".tmp-*")), "no half-written checkpoint"
    assert (ckpts / "latest").read_text().strip() == "step_00000004"


def test_nan_loss_skip_mode_counts_skipped_steps(runs: Sweep) -> None:
    run_dir = runs["nan_skip"]
    records = train_records(run_dir)
    assert [r["anomaly_skipped_steps"] for r in records] == [0, 0, 0, 0, 1, 2, 3, 4]
    final = torch.load(run_dir / "checkpoints" / "final.pt", weights_only=True)["model"]
    assert all(torch.isfinite(v).all() for v in final.values()), "skipped steps never touch the weights"


def test_check_sync_names_the_first_diverged_parameter_and_ranks(tmp_path: Path) -> None:
    proc, run_dir = run_cli(tmp_path, *FAULT, "+model.perturb_at=3", "debug.check_sync_every=2",
                            "trainer.max_steps=8", expect_rc=1)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert "parameters diverged across ranks at step 4: first diverged parameter 'layers.1.weight'" in out
    assert "ranks [1] differ from rank 0" in out
    assert run_dir is not None and not list((run_dir / "checkpoints").glob("step_*")), "no emergency save"


def test_compile_runs(runs: Sweep) -> None:
    assert "trainer.compile: torch.compile of MLP" in runs.log("compile")
    assert len(train_records(runs["compile"])) == 3


def test_gpt_validates_under_fsdp_and_fsdp_tp_like_single(tmp_path: Path, runs: Sweep) -> None:
    """Global batch 32 everywhere: single (1 rank), fsdp (16 x 2, size-based units that must keep the
    tied embedding and head together) and fsdp+tp (dp=1, tp=2); clipping on, validation twice."""
    losses, vals = {}, {}
    for name in ("single", "fsdp", "fsdp+tp"):
        if name == "single":  # the 1-process reference: the rank's code in this process
            run_dir = train_in_process(tmp_path / name, *GPT, *GPT_RUNS["single"])
        else:
            run_dir = runs[f"gpt-{name}"]
        if name == "fsdp":
            assert "root + 5 wrapped units (Embedding, Linear)" in runs.log("gpt-fsdp")
        losses[name] = [r["train/loss"] for r in train_records(run_dir)]
        vals[name] = [r["val/loss"] for r in val_records(run_dir)]
    assert len(vals["single"]) == 2
    for name in ("fsdp", "fsdp+tp"):
        assert losses[name] == pytest.approx(losses["single"], abs=1e-5), name
        assert vals[name] == pytest.approx(vals["single"], abs=1e-5), name


def test_validation_shards_of_unequal_batch_counts_do_not_hang_fsdp(tmp_path: Path, runs: Sweep) -> None:
    """9 val samples, batch 4: rank 0 has 2 batches, rank 1 one; FSDP's forward all-gathers, so the
    short rank joins with a discarded forward. The weighted result equals one process's over all 9
    samples (`single` with the global batch 8, trained in this process)."""
    fsdp = runs["uneven_val"]
    single = train_in_process(tmp_path / "single", *UNEVEN, "strategy=single", "nproc_per_node=1",
                              "trainer.batch_size=8")  # fmt: skip
    vals = {name: [r[k] for r in val_records(d) for k in ("val/loss", "val/acc")] for name, d in
            (("fsdp", fsdp), ("single", single))}  # fmt: skip
    assert len(vals["single"]) == 4
    assert vals["fsdp"] == pytest.approx(vals["single"], abs=1e-6)


def test_tp_dropout_keeps_replicated_parameters_identical_and_trains(tmp_path: Path, runs: Sweep) -> None:
    """tp on 2 ranks with dropout 0.1: the ranks of the tp group draw one dropout mask, so after 20
    steps the replicated parameters (embeddings, norms, replicated biases) are bitwise identical on
    both ranks; and the loss falls about as far as with dropout 0 (single, same batch, in process)."""
    run_dir = runs["gpt-tp-dropout"]
    dumps = [torch.load(runs.cwd / "tp_dumps" / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert {"embed.tok.weight", "blocks.0.ln1.weight", "head.ln.bias", "blocks.0.fc_out.bias"} <= set(
        dumps[0]
    )
    differ = [k for k in dumps[0] if not torch.equal(dumps[0][k], dumps[1][k])]
    assert differ == [], f"replicated parameters differ across the tp ranks: {differ}"
    dropout = train_losses(run_dir)
    plain_args = [o for o in TP_DROPOUT if not o.startswith(("model._target_", "model.dump_dir", "model.dropout",
                  "model.vocab_size", "model.block_size", "strategy="))]  # fmt: skip
    plain = train_losses(
        train_in_process(tmp_path / "single", *plain_args, "strategy=single", "nproc_per_node=1")
    )
    assert len(dropout) == len(plain) == 20
    fell, fell_plain = dropout[0] - sum(dropout[-5:]) / 5, plain[0] - sum(plain[-5:]) / 5
    print(f"loss fell {fell:.3f} with dropout 0.1 (tp), {fell_plain:.3f} with dropout 0 (single)")
    assert fell > 0.5 * fell_plain > 0, (dropout, plain)


def test_ema_under_fsdp_on_two_ranks_equals_averaged_model(
    tmp_path: Path, runs: Sweep, monkeypatch: pytest.MonkeyPatch
) -> None:
    """20 steps, decay 0.9: the EMA sharded over 2 fsdp ranks, exported (`export --ema`, the two
    shards consolidated), equals AveragedModel(get_ema_multi_avg_fn(0.9)) of a single process
    updated after each of the same steps, within 1e-6."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    from disttrain import checkpoint
    from disttrain.engine import loop
    from disttrain.models import build_model
    from disttrain.rundir import read_config

    ref: list[AveragedModel] = []
    step = loop.Engine.train_step

    def step_and_average(self: loop.Engine, micro_batches: list) -> tuple:  # type: ignore[type-arg]
        out = step(self, micro_batches)
        if not ref:
            ref.append(AveragedModel(self.model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True))
        ref[0].update_parameters(self.model)
        return out

    monkeypatch.setattr(loop.Engine, "train_step", step_and_average)
    single = train_in_process(tmp_path / "single", *EMA, "strategy=single", "nproc_per_node=1",
                              "trainer.batch_size=32")  # fmt: skip
    fsdp = runs["ema-fsdp"]
    model = build_model(read_config(fsdp)["model"])
    checkpoint.export_model(fsdp / "checkpoints", tmp_path / "ema.pt", model, ema=True)
    ema = torch.load(tmp_path / "ema.pt", weights_only=True)
    averaged = ref[0].module.state_dict()
    assert sorted(ema) == sorted(averaged)
    for name, value in averaged.items():
        torch.testing.assert_close(ema[name], value, rtol=0, atol=1e-6)
    sharded, whole = ([r["val_ema/loss"] for r in val_records(d)] for d in (fsdp, single))
    assert len(whole) == 2 and sharded == pytest.approx(whole, abs=1e-5)
