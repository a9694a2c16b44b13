"""Engine depth in this process at world size 1 (gloo over a HashStore): bf16 GPT on the shipped
text with its throughput numbers, fp16 loss scaling under ddp, FSDP's bf16 policy, activation
checkpointing, out-of-memory halving (with the profiler and grad stats) and its give-up.

Each run is what a rank does (worker.train: build, fit, summary.json) from a composed, checked
config; what needs two ranks (a NaN or a desync on one rank, fp16 under fsdp's sharded scaler,
uneven validation shards) stays in tests/integration/test_engine_depth.py.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from shared_support import TINY_GPT, check_one_fp16_overflow
from unit_support import train_in_process as run
from unit_support import train_records

from disttrain.checkpoint import read_meta
from disttrain.models.gpt import GPT
from disttrain.observe.metrics import read_metrics
from disttrain.testing import FAULT_MLP

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("one_rank")]

FAULT = ("data=synthetic", *FAULT_MLP, "trainer.log_every=1")


def test_gpt_on_text_in_bf16_under_ddp_learns_and_reports_throughput(tmp_path: Path) -> None:
    summary = run(
        tmp_path, *TINY_GPT, "strategy=ddp", "amp=bf16", "trainer.batch_size=32", "trainer.max_steps=200",
        "trainer.log_every=20", "optim.lr=3e-3",
    )  # fmt: skip
    records = train_records(tmp_path)
    first, last = records[0], records[-1]
    assert last["train/loss"] < 0.6 * first["train/loss"], (first, last)
    assert last["train/loss"] < 3.0 and last["tokens_per_s"] > 0 and 0 <= last["data_wait_frac"] <= 1
    assert "mfu" not in last, "no MFU without a known device peak"
    tokens_per_step = 32 * 32  # global batch x block
    gpt = GPT(vocab_size=256, block_size=32, dim=32, n_layers=1, n_heads=2)
    assert last["flops_per_step"] == gpt.flops_per_token() * tokens_per_step
    assert last["tokens_per_s"] == pytest.approx(last["samples_per_s"] * 32, rel=1e-9)
    assert last["samples_per_s"] == pytest.approx(32 / last["step_time_s"], rel=1e-6)
    assert summary["val/ppl"] < 25
    assert json.loads((tmp_path / "summary.json").read_text())["val/ppl"] == summary["val/ppl"]


def test_fp16_overflow_under_ddp_skips_that_step_and_lowers_the_scale(tmp_path: Path) -> None:
    run(tmp_path, *FAULT, "strategy=ddp", "amp=fp16", "+model.inf_grad_at=3", "trainer.max_steps=12",
        "trainer.ckpt_every=6")  # fmt: skip
    check_one_fp16_overflow(train_records(tmp_path))
    assert read_meta(tmp_path / "checkpoints" / "step_00000012")["has_scaler"] is True


def test_bf16_under_fsdp_trains(tmp_path: Path) -> None:
    """FSDP's mixed-precision policy follows amp: params gathered in bf16, gradients reduced in fp32."""
    run(
        tmp_path, "data=synthetic", "strategy=fsdp", "amp=bf16", "trainer.max_steps=12", "trainer.log_every=1"
    )
    losses = [r["train/loss"] for r in train_records(tmp_path)]
    assert len(losses) == 12 and losses[-1] < 0.8 * losses[0], losses


def test_activation_checkpointing_gives_the_same_losses(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="disttrain")
    runs = []
    for flag in ("false", "true"):  # true: full, as before selective existed
        # one validation batch: the whole text split is ~90 batches of 16 after 5 steps (the losses
        # compared are training's)
        common = ("strategy=single", "trainer.batch_size=16", "trainer.max_steps=5", "trainer.log_every=1",
                  "trainer.val_batches=1")  # fmt: skip
        run(
            tmp_path / flag,
            *TINY_GPT,
            "model.n_layers=2",
            *common,
            f"trainer.activation_checkpointing={flag}",
        )
        runs.append([r["train/loss"] for r in train_records(tmp_path / flag)])
    assert len(runs[0]) == 5
    assert runs[0] == runs[1]
    assert "trainer.activation_checkpointing=full: 2 blocks (Block) recompute in backward" in caplog.text


def test_oom_halves_the_micro_batch_and_profiler_and_grad_stats_write_their_files(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Out of memory above 8 samples: the 32-sample micro-batch is cut twice (grad_accum 4, the same
    global batch); the profiler traces steps 3-4 into rank0's file; grad stats every step."""
    run(
        tmp_path, *FAULT, "strategy=single", "+model.oom_above=8", "trainer.oom=auto_microbatch", "trainer.max_steps=6",
        "profile=true", "profiler.wait=1", "profiler.warmup=1", "profiler.active=2", "debug.log_grad_stats=true",
        "observe.sinks=[tensorboard]",
    )  # fmt: skip
    assert "micro-batch 32 -> 16, grad_accum 1 -> 2" in caplog.text
    assert "micro-batch 16 -> 8, grad_accum 2 -> 4" in caplog.text
    records = train_records(tmp_path)
    assert {r["micro_batch"] for r in records} == {8.0} and len(records) == 6
    assert records[-1]["train/loss"] < records[0]["train/loss"]
    (trace,) = (tmp_path / "profile").glob("rank*.pt.trace.json")
    assert trace.name.startswith("rank0.")
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("name") == "ProfilerStep#3" for e in events), "active: steps 3-4 (0-based 2, 3)"
    grads = [r for r in read_metrics(tmp_path) if "grad_norm/layers.1.weight" in r]
    assert len(grads) == 6 and all(r["grad_norm/layers.1.weight"] > 0 for r in grads)
    assert list((tmp_path / "tensorboard").iterdir())


def test_oom_in_backward_retries_the_step_with_the_same_math(tmp_path: Path) -> None:
    """Review GPU #7: an OOM raised inside backward (after the output layer's gradient exists) is
    retried from a fresh forward with half micro-batches; the losses are those of a run that never
    ran out of memory (the same samples, the same mean gradient)."""
    common = (*FAULT, "strategy=single", "trainer.oom=auto_microbatch", "trainer.max_steps=4")
    run(tmp_path / "oom", *common, "+model.oom_above=8", "+model.oom_in=backward")
    run(tmp_path / "fits", *common)
    oom, fits = train_records(tmp_path / "oom"), train_records(tmp_path / "fits")
    assert [r["micro_batch"] for r in oom] == [8.0] * 4 and [r["micro_batch"] for r in fits] == [32.0] * 4
    assert [r["train/loss"] for r in oom] == pytest.approx([r["train/loss"] for r in fits], rel=1e-5)


def test_oom_at_micro_batch_one_gives_up_clearly(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="even with a micro-batch of 1 sample") as info:
        run(tmp_path, *FAULT, "strategy=single", "+model.oom_above=0.5", "trainer.oom=auto_microbatch",
            "trainer.batch_size=2", "trainer.max_steps=2")  # fmt: skip
    assert "at step 1 on rank 0" in str(info.value) and "HINT" in str(info.value)
