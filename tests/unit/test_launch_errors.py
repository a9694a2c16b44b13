"""The console's failure summary names the exception type and its first meaningful line (issue 23 #6)."""

from __future__ import annotations

import json
import traceback
from pathlib import Path
from types import SimpleNamespace

import pytest
from torch import nn

from disttrain.launch.errors import error_summary
from disttrain.launch.torchrun import first_failure

FIRST = "ValueError: fully_shard does not support containers that do not implement forward: ModuleList("


def _raise_multiline() -> None:
    """fully_shard's refusal as the review saw it: a message that ends with a module's repr."""
    blocks = nn.ModuleList([nn.ModuleList([nn.Linear(4, 4), nn.GELU()]) for _ in range(2)])
    raise ValueError(f"fully_shard does not support containers that do not implement forward: {blocks!r}")


def _traceback() -> str:
    try:
        _raise_multiline()
    except ValueError:
        return traceback.format_exc()
    raise AssertionError("unreachable")


def test_a_spawned_ranks_multiline_exception_is_named_by_its_type_and_first_line() -> None:
    """torch.multiprocessing's ProcessRaisedException text: its header, then the rank's traceback."""
    import torch.multiprocessing as mp

    text = _traceback()
    assert text.rstrip().endswith(")")  # the old summary (the last line) was a lone `)`
    message = f"\n\n-- Process 1 terminated with the following error:\n{text}"
    assert error_summary(str(mp.ProcessRaisedException(message, 1, 1234))) == FIRST


def test_a_torchrun_ranks_multiline_exception_is_named_from_its_error_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The error file as torchelastic's own @record handler writes it for the failing rank."""
    from torch.distributed.elastic.multiprocessing.errors.error_handler import ErrorHandler

    error_file = tmp_path / "error1.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    try:
        _raise_multiline()
    except ValueError as exc:
        ErrorHandler().record_exception(exc)
    assert json.loads(error_file.read_text())["message"]["message"].endswith(")")
    failures = {1: SimpleNamespace(exitcode=1, timestamp=100, error_file=str(error_file))}
    assert first_failure(failures) == (1, FIRST)


@pytest.mark.parametrize(
    ("text", "summary"),
    [
        (
            "Traceback (most recent call last):\n  File 'x.py', line 1\n    f()\nKeyError: 'w'\n",
            "KeyError: 'w'",
        ),
        ("RuntimeError:\n\n  the real reason\n)", "RuntimeError: the real reason"),  # message on line 2
        ("KeyboardInterrupt", "KeyboardInterrupt"),
        (  # chained: the exception that ended the rank, not the one it was handling
            "Traceback (most recent call last):\n  File 'a'\nOSError: disk\n\nDuring handling of the "
            "above exception, another exception occurred:\n\nTraceback (most recent call last):\n"
            "  File 'b'\nmylab.errors.DataError: shard 3 is empty\n  details (\n)",
            "mylab.errors.DataError: shard 3 is empty",
        ),
        ("", "an unknown error"),
    ],
)
def test_summary_of_other_exception_shapes(text: str, summary: str) -> None:
    assert error_summary(text) == summary


def test_a_signal_stop_is_an_interruption_not_a_failure(tmp_path: Path) -> None:
    """Ctrl-C (SIGINT, exit 130) is reported as what the user did, not "training failed"
    (docs-as-written review 3.5); a rank's own error still is a failure."""
    from disttrain.launch.errors import LaunchError

    stop = (
        "stopped by SIGINT: the ranks saved the signal checkpoint step_00000041 (step 41); continue with ..."
    )
    text = str(LaunchError(None, stop, tmp_path, exit_code=130)).splitlines()[0]
    assert text.startswith("interrupted by SIGINT: the ranks saved") and "failed" not in text, text
    assert str(LaunchError(1, "ValueError: bad", tmp_path)).startswith(
        "training failed: rank 1 raised ValueError"
    )


GLOO_MISMATCH = (
    "terminate called after throwing an instance of 'gloo::EnforceNotMet'\n"
    "  what():  [enforce fail at /__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:456] "
    "op.preamble.length <= op.nbytes. 128 vs 96. Received data size doesn't match expected size. Is there a "
    "distributed collective mismatch in your code?\n"
)


def test_a_rank_aborted_in_a_collective_mismatch_is_named_with_its_log_line_and_cause(tmp_path: Path) -> None:
    """Review 2026-11-28-real-workloads F2: gloo aborts (SIGABRT, no Python exception) a rank whose
    all-gather got another size than it expected (an uneven last validation batch); the console said
    only "rank 1 was killed by SIGABRT". Now: gloo's line from the rank's log, the likely cause and
    the helper (the rank's stderr as the launchers write it, logs/rank1.log)."""
    from disttrain.launch.errors import LaunchError, exit_code_message
    from disttrain.rundir import RunDir

    log = RunDir(tmp_path).rank_log(1)
    log.parent.mkdir(parents=True)
    log.write_text("[disttrain] step 20/20 loss 3.455\n" + GLOO_MISMATCH)
    head = str(LaunchError(1, exit_code_message(-6), tmp_path)).splitlines()[0]
    assert head.startswith("training failed: rank 1 was killed by SIGABRT (signal 6) inside a collective; its "
                           "log says: what():  [enforce fail"), head  # fmt: skip
    assert "Received data size doesn't match expected size" in head
    assert "Likely a collective mismatch" in head and "validation batches may be uneven" in head
    assert "disttrain.dist.gather_batch" in head
    log.write_text("Fatal Python error: Aborted\n")  # another abort: no cause guessed
    assert str(LaunchError(1, exit_code_message(-6), tmp_path)).splitlines()[0] == (
        "training failed: rank 1 was killed by SIGABRT (signal 6)"
    )
