"""Engine depth through the real CLI on 2 gloo CPU ranks, where ranks must agree: fp16 loss scaling
under fsdp, NaN on one rank, the parameter-sync check, gpt under fsdp and fsdp+tp, uneven
validation shards; and compile (1 rank).
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

from .conftest import run_cli, train_in_process, train_records, val_records

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

FAULT = ("data=synthetic", *FAULT_MLP, "trainer.log_every=1")


def test_fp16_overflow_under_fsdp_skips_that_step_and_lowers_the_scale(tmp_path: Path) -> None:
    """Every rank overflows at step 3: the sharded scaler skips that step on every shard."""
    _, run_dir = run_cli(
        tmp_path, *FAULT, "strategy=fsdp", "amp=fp16", "+model.inf_grad_at=3", "trainer.max_steps=12",
        "trainer.ckpt_every=6",
    )  # fmt: skip
    assert run_dir is not None
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


def test_nan_loss_skip_mode_counts_skipped_steps(tmp_path: Path) -> None:
    _, run_dir = run_cli(
        tmp_path, *FAULT, "+model.nan_at=5", "+model.nan_rank=1", "trainer.detect_anomaly=skip",
        "trainer.max_steps=8",
    )  # fmt: skip
    assert run_dir is not None
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


def test_compile_runs(tmp_path: Path) -> None:
    proc, run_dir = run_cli(tmp_path, "data=synthetic", "strategy=single", "nproc_per_node=1",
                            "trainer.compile=true", "trainer.max_steps=3", "model.hidden=[16]",
                            "trainer.log_every=1", timeout=300)  # fmt: skip
    assert "trainer.compile: torch.compile of MLP" in proc.stdout + proc.stderr
    assert run_dir is not None and len(train_records(run_dir)) == 3


def test_gpt_validates_under_fsdp_and_fsdp_tp_like_single(tmp_path: Path) -> None:
    """Global batch 32 everywhere: single (1 rank), fsdp (16 x 2, size-based units that must keep the
    tied embedding and head together) and fsdp+tp (dp=1, tp=2); clipping on, validation twice."""
    common = (*TINY_GPT, "trainer.batch_size=16", "trainer.max_steps=6", "trainer.val_every=3",
              "trainer.log_every=1", "trainer.clip_grad_norm=0.5", "backend.timeout=60")  # fmt: skip
    runs = {
        "single": ("strategy=single", "nproc_per_node=1", "trainer.batch_size=32"),
        "fsdp": ("strategy=fsdp", "strategy.min_num_params=1000"),
        "fsdp+tp": ("strategy=fsdp+tp", "trainer.batch_size=32"),
    }
    losses, vals = {}, {}
    for name, extra in runs.items():
        (tmp_path / name).mkdir()
        if name == "single":  # the 1-process reference: the rank's code in this process
            run_dir = train_in_process(tmp_path / name, *common, *extra)
        else:
            proc, run_dir = run_cli(tmp_path / name, *common, *extra, timeout=180)
        assert run_dir is not None
        if name == "fsdp":
            assert "root + 7 wrapped units (Embedding, Linear)" in proc.stdout + proc.stderr
        losses[name] = [r["train/loss"] for r in train_records(run_dir)]
        vals[name] = [r["val/loss"] for r in val_records(run_dir)]
    assert len(vals["single"]) == 2
    for name in ("fsdp", "fsdp+tp"):
        assert losses[name] == pytest.approx(losses["single"], abs=1e-5), name
        assert vals[name] == pytest.approx(vals["single"], abs=1e-5), name


def test_validation_shards_of_unequal_batch_counts_do_not_hang_fsdp(tmp_path: Path) -> None:
    """9 val samples, batch 4: rank 0 has 2 batches, rank 1 one; FSDP's forward all-gathers, so the
    short rank joins with a discarded forward. The weighted result equals one process's over all 9
    samples (`single` with the global batch 8, trained in this process)."""
    common = ("data=synthetic", "data.num_val_samples=9", "trainer.max_steps=4", "trainer.val_every=2",
              "backend.timeout=30")  # fmt: skip
    _, fsdp = run_cli(
        tmp_path, *common, "strategy=fsdp", "strategy.min_num_params=100", "trainer.batch_size=4"
    )
    single = train_in_process(tmp_path / "single", *common, "strategy=single", "nproc_per_node=1",
                              "trainer.batch_size=8")  # fmt: skip
    assert fsdp is not None
    vals = {name: [r[k] for r in val_records(d) for k in ("val/loss", "val/acc")] for name, d in
            (("fsdp", fsdp), ("single", single))}  # fmt: skip
    assert len(vals["single"]) == 4
    assert vals["fsdp"] == pytest.approx(vals["single"], abs=1e-6)
