"""disttrain.engine.loop through the real CLI with one rank (in-process: one process, no launcher)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from unit_support import disttrain_in_process

from disttrain.testing import FAULT_MLP

ONE = ("nproc_per_node=1", "data=synthetic", "trainer.progress=false", "threads_per_rank=1")


def test_an_empty_validation_set_records_no_val_metrics(
    scratch: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review D12: with 0 validation samples, val/loss 0.0 would read as a perfect model. And a
    command called in process counts Enter to first step from the call, not from an Enter this
    process had before (an earlier call's, or the process's start 1000 s ago)."""
    import time

    from disttrain.observe.phases import ENTER_ENV

    monkeypatch.setenv(ENTER_ENV, repr(time.time() - 1000))
    called = time.monotonic()
    proc = disttrain_in_process(
        "train", *ONE, "trainer.max_steps=3", "data.num_val_samples=0", "hydra.run.dir=run", cwd=scratch
    )
    took = time.monotonic() - called
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "the validation set is empty" in (scratch / "run" / "logs" / "rank0.log").read_text()
    records = [json.loads(x) for x in (scratch / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records and not any(k.startswith("val/") for r in records for k in r)
    summary = json.loads((scratch / "run" / "summary.json").read_text())
    assert not any(k.startswith("val/") for k in summary), summary
    # Issue 38: this rank's peak host memory (VmHWM since training started), one entry per rank.
    (rss,) = summary["host_rss_peak_mib_by_rank"]
    assert summary["host_rss_peak_mib"] == rss > 50, summary  # the rank holds torch at least
    # Issue 26 #4: this rank's step-time quantiles, one row per rank.
    (p50,), (p95,) = summary["step_time_p50_s_by_rank"], summary["step_time_p95_s_by_rank"]
    assert 0 < p50 <= p95, summary
    assert 0 < summary["enter_to_first_step_s"] < took, (summary["enter_to_first_step_s"], took)


def test_no_emergency_checkpoint_before_the_first_optimizer_step(scratch: Path) -> None:
    """An exception in the first step leaves no step-0 'emergency checkpoint' of an untrained model."""
    fault = (*FAULT_MLP, "+model.raise_at=1", "trainer.max_steps=3")
    proc = disttrain_in_process("train", *ONE, *fault, "hydra.run.dir=run", cwd=scratch)
    assert proc.returncode == 1
    assert "injected failure at training forward 1" in proc.stderr, proc.stderr[-2000:]
    assert "no emergency checkpoint" in (scratch / "run" / "logs" / "rank0.log").read_text()
    assert not list((scratch / "run").glob("checkpoints/step_*"))


def test_the_final_checkpoint_is_saved_before_the_final_validation(
    scratch: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review 2026-11-28-real-workloads F2: a final validation that fails (there: an uneven batch in a
    task's all-gather) lost the whole run, as the final checkpoint came after it. Save first: the
    final checkpoint (reason `final`, not an emergency one) is on disk when the validation fails."""
    from disttrain import checkpoint
    from disttrain.engine import loop

    def failing(*args: object, **kwargs: object) -> None:
        raise RuntimeError("injected failure in the final validation")

    monkeypatch.setattr(loop, "validation", failing)
    run = ("trainer.max_steps=3", "trainer.val_every=3", "hydra.run.dir=run")
    proc = disttrain_in_process("train", *ONE, *run, cwd=scratch)
    assert proc.returncode == 1 and "injected failure in the final validation" in proc.stderr
    assert checkpoint.read_meta(scratch / "run" / "checkpoints" / "step_00000003")["reason"] == "final"
