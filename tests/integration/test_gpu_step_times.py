"""Step times on a real CUDA GPU (issue 34 #6): skipped without CUDA (tests/conftest.py's hook).

A GPU-bound run whose host queues its steps far ahead of the device: each step's time in
summary.json must be the device's (its timing events), not how fast the host queued the kernels.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .conftest import clean_env, run_cli, train_records

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(600)]


def test_step_time_p50_is_the_devices_step_time(tmp_path: Path) -> None:
    """Big matmuls (12288-wide layers, batch 4096: ~7 TFLOP, ~20-40 ms of GPU per step, ~1 ms to
    queue), batches loaded by 8 workers into pinned memory (a few ms each, no stream sync in the
    copy), a log step every 20 steps: the host runs up to 20 steps ahead, its data waits overlap
    the device's queued work. The reference is the second log window's step_time_s: its clock is
    read after the loss read waited for the device, so it is device-synced. The p50 of the per-step
    times must match it (host-timed, it was the queueing time, several times smaller; with the
    host's data waits added to the device's time, it would count the overlapped waits twice)."""
    _proc, run_dir = run_cli(
        tmp_path,
        "data=synthetic",
        "data.num_samples=196608",  # 48 steps: no end of epoch (and its validation) in a window
        "data.num_workers=8",
        "data.pin_memory=true",
        "model.hidden=[12288,12288,12288]",  # 0.3 B parameters: a 3.6 GB final checkpoint
        "trainer.batch_size=4096",
        "trainer.max_steps=40",
        "trainer.log_every=20",
        "trainer.val_every=0",
        "data.num_val_samples=4096",
        "checkpoint.export_final=false",
        env=clean_env(CUDA_VISIBLE_DEVICES="0"),
    )
    assert run_dir is not None
    windows = [r for r in train_records(run_dir) if "step_time_s" in r]
    assert [r["step"] for r in windows] == [20, 40], windows
    synced = windows[1]["step_time_s"]
    summary = json.loads((run_dir / "summary.json").read_text())
    (p50,) = summary["step_time_p50_s_by_rank"]
    assert 0.75 * synced <= p50 <= 1.25 * synced, (p50, synced)
