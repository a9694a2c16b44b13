"""disttrain.launch.torchrun in one process: which rank and cause the failure summary names."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from unit_support import checked_run

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


def test_under_nccls_watchdog_the_sigtermed_hung_rank_is_named_not_its_sigabrt_victims(
    tmp_path: Path,
) -> None:
    """Review GPU #8: NCCL's watchdog SIGABRTs the 3 ranks that waited (first, no error file); the
    agent then SIGTERMs the hung rank 2. Rank 2 is the cause, and the message names the watchdog."""
    failures = {r: _failure(tmp_path, r, -6, None, 100) for r in (0, 1, 3)}
    failures[2] = _failure(tmp_path, 2, -15, None, 101)
    rank, message = first_failure(failures, watchdog=True)
    assert rank == 2 and message.startswith("was killed by SIGTERM (signal 15)")
    assert "rank(s) [0, 1, 3] were aborted (SIGABRT) by NCCL's watchdog" in message
    assert "HINT: look at rank 2's log" in message
    # A hung rank that ignored SIGTERM is SIGKILLed after the grace, later still: it is the cause too.
    failures[2] = _failure(tmp_path, 2, -9, None, 230)
    assert first_failure(failures, watchdog=True)[0] == 2
    # A rank's own exception still comes first, and all-SIGABRT names the earliest without the hint.
    failures[3] = _failure(tmp_path, 3, 1, "RuntimeError: CUDA error: an illegal memory access", 101)
    assert first_failure(failures, watchdog=True) == (3, "RuntimeError: CUDA error: an illegal memory access")
    aborted = {r: _failure(tmp_path, r, -6, None, 100 + r) for r in (1, 0)}
    assert first_failure(aborted, watchdog=True) == (0, "was killed by SIGABRT (signal 6)")


def test_without_the_watchdog_a_sigabrt_is_a_crash_named_before_the_sigtermed_survivors(
    tmp_path: Path,
) -> None:
    """gloo: a native abort (a C++ assertion) on rank 1 is the cause; rank 0 was only stopped."""
    failures = {0: _failure(tmp_path, 0, -15, None, 101), 1: _failure(tmp_path, 1, -6, None, 100)}
    assert first_failure(failures) == (1, "was killed by SIGABRT (signal 6)")


@pytest.mark.parametrize(
    ("name", "cuda", "mode", "expected"),
    [("auto", True, None, True), ("auto", False, None, False), ("nccl", True, "0", False),
     ("nccl", True, "3", True), ("gloo", True, None, False)],
)  # fmt: skip
def test_the_watchdog_applies_to_nccl_under_torchruns_error_handling(
    monkeypatch: pytest.MonkeyPatch, name: str, cuda: bool, mode: str | None, expected: bool
) -> None:
    import torch

    from disttrain.launch.torchrun import nccl_watchdog

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    if mode is None:
        monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    else:
        monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", mode)
    assert nccl_watchdog(checked_run([f"backend={name}", "nproc_per_node=2"])) is expected


def test_nccl_ranks_get_the_flight_recorder_dumping_into_the_run_logs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 26 #4: with nccl the ranks record their last collectives and dump them on a timeout
    into logs/; gloo has no recorder (nothing set); a value the user exported is kept."""
    from disttrain.launch import flight_recorder_environment

    for key in (
        "TORCH_NCCL_TRACE_BUFFER_SIZE",
        "TORCH_NCCL_DUMP_ON_TIMEOUT",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
    ):
        monkeypatch.delenv(key, raising=False)
    gloo, nccl = (checked_run([f"backend={name}", "nproc_per_node=2"]) for name in ("gloo", "nccl"))
    assert flight_recorder_environment(gloo, tmp_path) == {}
    assert flight_recorder_environment(nccl, tmp_path) == {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(tmp_path / "logs" / "nccl_trace_rank_"),
    }
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "50")
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in flight_recorder_environment(nccl, tmp_path)


def test_d25_a_sigbus_names_a_truncated_token_file_as_the_likely_cause(tmp_path: Path) -> None:
    """Reliability review 2026-11-28 D25: a token file truncated under a running job ended as
    "rank 0 was killed by SIGBUS (signal 7)" with no cause named."""
    failures = {0: _failure(tmp_path, 0, -7, None, 100), 1: _failure(tmp_path, 1, -15, None, 101)}
    rank, message = first_failure(failures)
    assert rank == 0 and message.startswith("was killed by SIGBUS (signal 7): a memory-mapped file shrank")
    assert "data.path" in message
