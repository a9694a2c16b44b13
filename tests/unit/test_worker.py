"""disttrain.worker in one process: what a rank does to the run dir before training."""

from __future__ import annotations

import json
from pathlib import Path

from disttrain.observe.metrics import truncate_metrics


def test_truncate_metrics_drops_later_steps_and_a_torn_last_line(tmp_path: Path) -> None:
    """Review B26: a crash mid-write leaves half a line; resuming must not fail on it, every time."""
    path = tmp_path / "metrics.jsonl"
    records = [{"step": s, "time": 1.0 + s, "train/loss": 1.0 / s} for s in (10, 20, 30)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 31, "time": 17953')
    truncate_metrics(path, 20)
    assert [json.loads(ln) for ln in path.read_text().splitlines()] == records[:2]
    truncate_metrics(path, 30)  # nothing left to drop: unchanged
    assert [json.loads(ln) for ln in path.read_text().splitlines()] == records[:2]


def test_summary_is_written_unless_stopped_or_nothing_trained(tmp_path: Path) -> None:
    from disttrain.observe.summary import record_summary

    path = tmp_path / "summary.json"
    record_summary({"steps": 3, "stopped_by": "SIGTERM"}, path, trained=True)
    record_summary({"steps": 3}, path, trained=False)  # a finished run resumed: nothing ran
    assert not path.exists()
    record_summary({"steps": 3}, path, trained=True)
    assert json.loads(path.read_text()) == {"steps": 3}
