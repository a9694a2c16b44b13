"""Issue 14: progress in any log, metric sinks (MLflow, W&B, CSV) with tracker resume, rerun, plots."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.integration.conftest import run_cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROGRESS = re.compile(r"step (\d+)/(\d+) loss [\d.e+-]+ lr [\d.e+-]+ [\d,]+ samples/s")


def test_progress_lines_go_to_stderr_and_rank0_log_stdout_is_the_result(tmp_path: Path) -> None:
    """No TTY: one plain progress line per log_every on stderr and in rank0.log; stdout: `done:` only."""
    proc, run_dir = run_cli(
        tmp_path, "launcher=spawn", "data=synthetic", "trainer.max_steps=6", "trainer.log_every=2"
    )
    assert run_dir is not None
    steps = [int(m.group(1)) for m in PROGRESS.finditer(proc.stderr)]
    assert steps == [2, 4, 6], proc.stderr
    assert all(m.group(2) == "6" for m in PROGRESS.finditer(proc.stderr))
    logged = [int(m.group(1)) for m in PROGRESS.finditer((run_dir / "logs" / "rank0.log").read_text())]
    assert logged == [2, 4, 6]
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("done: 6 steps"), proc.stdout
