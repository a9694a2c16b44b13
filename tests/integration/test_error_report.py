"""A rank that raises: exit code 1, one short message naming the rank, the error and its log."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import QUICK, run_cli, write_module

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

FAILING = """\
import torch.distributed as dist
from torch import nn


class Net(nn.Module):
    def __init__(self, in_features: int, num_classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(in_features, num_classes)

    def forward(self, x):
        if dist.is_initialized() and dist.get_rank() == 1:
            raise RuntimeError("deliberate failure on rank 1")
        return self.fc(x)
"""


@pytest.mark.parametrize("launcher", ["torchrun", "spawn"])
def test_failing_rank_is_reported_without_parent_traceback(tmp_path: Path, launcher: str) -> None:
    write_module(tmp_path, "mylab.bad", FAILING)
    proc, run_dir = run_cli(
        tmp_path,
        f"launcher={launcher}",
        *QUICK,
        "model._target_=mylab.bad.Net",
        "model.in_features=${data.num_features}",  # a swapped node starts clean: wire it to the data
        "model.num_classes=${data.num_classes}",
        expect_rc=1,
    )
    assert run_dir is not None, "the run dir is frozen before launch, so the failure has logs to point to"
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    head = next(i for i, ln in enumerate(lines) if ln.startswith("disttrain: training failed"))
    message = "\n".join(lines[head:])
    assert "rank 1" in lines[head] and "RuntimeError: deliberate failure on rank 1" in lines[head], message
    assert len(lines) - head <= 4, f"the failure message must be the last thing on stderr:\n{message}"
    assert not any(ln.startswith("Traceback") for ln in lines), "the parent CLI printed a traceback"

    log_lines = [ln for ln in lines[head:] if ln.strip().startswith("log:")]
    assert log_lines, message
    log = Path(log_lines[0].split("log:", 1)[1].strip())
    assert log == run_dir / "logs" / "rank1.log"
    text = log.read_text()
    assert "Traceback" in text and "deliberate failure on rank 1" in text, (
        "the rank's log holds the traceback"
    )

    assert not (run_dir / "summary.json").exists()
    assert not (run_dir / "checkpoints" / "final.pt").exists()
