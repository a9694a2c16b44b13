"""Engine depth through the real CLI on 2 gloo CPU ranks: mixed precision (bf16, fp16 with loss
scaling) under ddp and fsdp, gpt on the shipped text, activation checkpointing, NaN detection,
compile, the profiler and the parameter-sync check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from disttrain.checkpoint import read_meta
from disttrain.models.gpt import GPT

from .conftest import read_metrics, run_cli, train_records, val_records

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

TINY_GPT = (
    "model=gpt",
    "data=text",
    "model.dim=32",
    "model.n_layers=1",
    "model.n_heads=2",
    "data.block_size=32",
    "trainer.batch_size=16",
)
# A swapped _target_ starts from a clean node: FaultMLP gets the MLP arguments it forwards.
FAULT_MLP_WIRING = ("model.in_features=${data.num_features}", "model.num_classes=${data.num_classes}")
FAULT = (
    "data=synthetic",
    "model._target_=disttrain.testing.FaultMLP",
    *FAULT_MLP_WIRING,
    "trainer.log_every=1",
)


def test_gpt_on_text_in_bf16_loss_falls_well_below_its_start(tmp_path: Path) -> None:
    _, run_dir = run_cli(
        tmp_path, *TINY_GPT, "amp=bf16", "trainer.max_steps=200", "trainer.log_every=20", "optim.lr=3e-3",
        timeout=240,
    )  # fmt: skip
    assert run_dir is not None
    records = train_records(run_dir)
    first, last = records[0], records[-1]
    assert last["train/loss"] < 0.6 * first["train/loss"], (first, last)
    assert last["train/loss"] < 3.0 and last["tokens_per_s"] > 0 and 0 <= last["data_wait_frac"] <= 1
    assert "mfu" not in last, "no MFU without a known device peak"
    tokens_per_step = 16 * 2 * 32  # batch x ranks x block
    gpt = GPT(vocab_size=256, block_size=32, dim=32, n_layers=1, n_heads=2)
    assert last["flops_per_step"] == gpt.flops_per_token() * tokens_per_step
    assert last["tokens_per_s"] == pytest.approx(last["samples_per_s"] * 32, rel=1e-9)
    assert last["samples_per_s"] == pytest.approx(16 * 2 / last["step_time_s"], rel=1e-6)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["val/ppl"] < 25


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_fp16_overflow_skips_that_step_and_lowers_the_scale(tmp_path: Path, strategy: str) -> None:
    _, run_dir = run_cli(
        tmp_path, *FAULT, f"strategy={strategy}", "amp=fp16", "+model.inf_grad_at=3", "trainer.max_steps=12",
        "trainer.ckpt_every=6",
    )  # fmt: skip
    assert run_dir is not None
    records = train_records(run_dir)
    scales = [r["amp/scale"] for r in records]
    skipped = [r["amp/skipped_steps"] for r in records]
    assert scales[1] == 65536.0 and scales[2] == 32768.0 and scales[-1] == 32768.0, scales
    assert skipped[1] == 0 and skipped[2:] == [1.0] * (len(records) - 2), skipped
    assert records[-1]["train/loss"] < records[0]["train/loss"]
    meta = read_meta(run_dir / "checkpoints" / "step_00000012")
    assert meta["has_scaler"] is True


def test_bf16_under_fsdp_trains(tmp_path: Path) -> None:
    """FSDP's mixed-precision policy follows amp: params gathered in bf16, gradients reduced in fp32."""
    _, run_dir = run_cli(tmp_path, "data=synthetic", "strategy=fsdp", "amp=bf16", "trainer.max_steps=12",
                         "trainer.log_every=1")  # fmt: skip
    assert run_dir is not None
    losses = [r["train/loss"] for r in train_records(run_dir)]
    assert losses[-1] < 0.8 * losses[0], losses


def test_activation_checkpointing_gives_the_same_losses(tmp_path: Path) -> None:
    runs = []
    for flag in ("false", "true"):
        (tmp_path / flag).mkdir()
        _, run_dir = run_cli(tmp_path / flag, *TINY_GPT, "strategy=single", "nproc_per_node=1", f"trainer.activation_checkpointing={flag}",
                             "trainer.max_steps=5", "trainer.log_every=1")  # fmt: skip
        assert run_dir is not None
        runs.append([r["train/loss"] for r in train_records(run_dir)])
    assert runs[0] == pytest.approx(runs[1], rel=1e-5, abs=1e-6)


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


def test_oom_halves_the_micro_batch_and_profiler_and_grad_stats_write_their_files(tmp_path: Path) -> None:
    proc, run_dir = run_cli(
        tmp_path, *FAULT, "+model.oom_above=8", "trainer.oom=auto_microbatch", "trainer.max_steps=6",
        "profile=true", "profiler.wait=1", "profiler.warmup=1", "profiler.active=2", "debug.log_grad_stats=true",
    )  # fmt: skip
    assert run_dir is not None
    assert "micro-batch 32 -> 16, grad_accum 1 -> 2" in proc.stdout + proc.stderr
    records = train_records(run_dir)
    assert {r["micro_batch"] for r in records} == {8.0} and len(records) == 6
    assert records[-1]["train/loss"] < records[0]["train/loss"]
    traces = sorted((run_dir / "profile").glob("rank*.pt.trace.json"))
    assert [t.name.split(".")[0] for t in traces] == ["rank0", "rank1"]
    for trace in traces:
        events = json.loads(trace.read_text())["traceEvents"]
        assert any(e.get("name") == "ProfilerStep#3" for e in events), "active: steps 3-4 (0-based 2, 3)"
    grads = [r for r in read_metrics(run_dir) if "grad_norm/layers.1.weight" in r]
    assert len(grads) == 6 and all(r["grad_norm/layers.1.weight"] > 0 for r in grads)
    assert list((run_dir / "tensorboard").iterdir())


def test_oom_at_micro_batch_one_gives_up_clearly(tmp_path: Path) -> None:
    proc, _ = run_cli(tmp_path, *FAULT, "+model.oom_above=0.5", "trainer.oom=auto_microbatch",
                      "trainer.batch_size=2", "trainer.max_steps=2", "strategy=single", "nproc_per_node=1",
                      expect_rc=1)  # fmt: skip
    assert "even with a micro-batch of 1 sample" in proc.stdout + proc.stderr


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
    common = (*TINY_GPT, "trainer.max_steps=6", "trainer.val_every=3", "trainer.log_every=1",
              "trainer.clip_grad_norm=0.5", "backend.timeout=60")  # fmt: skip
    runs = {
        "single": ("strategy=single", "nproc_per_node=1", "trainer.batch_size=32"),
        "fsdp": ("strategy=fsdp", "strategy.min_num_params=1000"),
        "fsdp+tp": ("strategy=fsdp+tp", "trainer.batch_size=32"),
    }
    losses, vals = {}, {}
    for name, extra in runs.items():
        (tmp_path / name).mkdir()
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
    short rank joins with a discarded forward. The weighted result equals ddp's (no collective)."""
    common = ("data=synthetic", "data.num_val_samples=9", "trainer.batch_size=4", "trainer.max_steps=4",
              "trainer.val_every=2", "backend.timeout=30")  # fmt: skip
    vals = {}
    for strategy in ("ddp", "fsdp"):
        (tmp_path / strategy).mkdir()
        _, run_dir = run_cli(
            tmp_path / strategy,
            *common,
            f"strategy={strategy}",
            "strategy.min_num_params=100" if strategy == "fsdp" else "strategy.bucket_cap_mb=25",
            timeout=120,
        )
        assert run_dir is not None
        vals[strategy] = [r[k] for r in val_records(run_dir) for k in ("val/loss", "val/acc")]
    assert len(vals["ddp"]) == 4
    assert vals["fsdp"] == pytest.approx(vals["ddp"], abs=1e-6)
