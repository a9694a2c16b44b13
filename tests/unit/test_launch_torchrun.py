"""disttrain.launch.torchrun in one process: which rank and cause the failure summary names."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from disttrain.launch.torchrun import first_failure


def _failure(
    tmp_path: Path, rank: int, exitcode: int, message: str | None, timestamp: int
) -> SimpleNamespace:
    error_file = tmp_path / f"error{rank}.json"
    if message is not None:  # what torchelastic's @record writes for a rank that raised
        error_file.write_text(json.dumps({"message": {"message": f"Traceback ...\n{message}"}}))
    return SimpleNamespace(exitcode=exitcode, timestamp=timestamp, error_file=str(error_file))


def test_the_rank_that_raised_is_named_not_the_one_the_agent_sent_sigterm(tmp_path: Path) -> None:
    """Review D17: rank 0 (SIGTERMed by the agent, same second, lower rank) is not the cause."""
    failures = {
        0: _failure(tmp_path, 0, -15, None, 100),
        1: _failure(tmp_path, 1, 1, "ValueError: Size mismatch for model.layers.1.weight", 100),
    }
    assert first_failure(failures) == (1, "ValueError: Size mismatch for model.layers.1.weight")


def test_a_killed_rank_is_named_before_survivors_that_saw_it_die(tmp_path: Path) -> None:
    failures = {
        0: _failure(tmp_path, 0, 1, "RuntimeError: rank 0: a peer rank died at step 4 (...)", 100),
        1: _failure(tmp_path, 1, -9, None, 100),
        2: _failure(tmp_path, 2, -15, None, 100),
    }
    assert first_failure(failures) == (1, "was killed by SIGKILL (signal 9)")
