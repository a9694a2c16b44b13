"""disttrain.observe.log: what a rank without the console writes raw goes to its log."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """
import os, sys, warnings
from pathlib import Path
from disttrain.observe.log import stderr_into_log
stderr_into_log(Path(sys.argv[1]), 1)
os.write(2, b"[W TCPStore.cpp:125] recvValue failed. frame #0: c10::Error::Error\\n")
warnings.warn("a library's warning")
print("result on stdout")
"""


def test_a_ranks_raw_stderr_goes_to_its_log_not_the_console(tmp_path: Path) -> None:
    """Issue 26 #6: C++ writes on fd 2 (TCPStore's `frame #0: c10::Error` stacks) and Python
    warnings of a rank other than 0 land in its log file; the node's console shows none of it."""
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=60, check=True
    )
    assert proc.stderr == "" and proc.stdout == "result on stdout\n"
    text = (tmp_path / "rank1.log").read_text()
    assert "frame #0: c10::Error::Error" in text and "a library's warning" in text


RANK0 = """
import logging, os, sys, warnings
from pathlib import Path
from disttrain.observe.log import console_apart, setup_logging
console_apart(Path(sys.argv[1]))
log = setup_logging(Path(sys.argv[1]), 0, to_console=True)
log.info("step 1/2 loss 0.5")
os.write(2, b"USDT:2026-11-25 16:59:25 8967:8967 SyncActivityProfilerHandler.cpp:52] profiler_start\\n")
warnings.warn("FSDP2-wrapped module (FSDPMLP) returned a view tensor.")
hf = logging.getLogger("transformers")  # transformers' own handler, made at its first use
hf.addHandler(logging.StreamHandler())
hf.propagate = False
hf.warning("Model config: bos_token_id must be None or an integer within the vocabulary")
log.info("step 2/2 loss 0.25")
"""


def test_rank0_keeps_disttrain_lines_on_the_console_and_the_rest_in_its_log(tmp_path: Path) -> None:
    """Docs-as-written review 3.4: rank 0 in its own process (console_apart): disttrain's lines stay
    on the console; kineto's C++ `profiler_start`, Python warnings (FSDP2's view tensor) and a
    library's own stderr handler (transformers') go to rank0.log with disttrain's lines."""
    proc = subprocess.run(
        [sys.executable, "-c", RANK0, str(tmp_path)], capture_output=True, text=True, timeout=60, check=True
    )
    assert proc.stderr == "[disttrain] step 1/2 loss 0.5\n[disttrain] step 2/2 loss 0.25\n", proc.stderr
    text = (tmp_path / "rank0.log").read_text()
    for line in ("profiler_start", "returned a view tensor", "bos_token_id", "step 1/2", "step 2/2"):
        assert line in text, text


def test_transformers_warnings_of_the_dry_build_stay_off_the_console(monkeypatch: pytest.MonkeyPatch) -> None:
    """Docs-as-written review 3.4: the parent's dry build of an HF model printed transformers'
    config warnings on the console (each rank logs them again). Quiet inside, restored after.
    (Asserted on the loggers' levels: transformers' handler keeps the stderr of its first use,
    which in a pytest worker may be an earlier test's capture.)"""
    tl = pytest.importorskip("transformers.utils.logging")
    from disttrain.observe.log import transformers_quiet

    monkeypatch.delenv("TRANSFORMERS_VERBOSITY", raising=False)
    tl.set_verbosity(logging.INFO)
    config = tl.get_logger("transformers.configuration_utils")
    with transformers_quiet():
        assert not config.isEnabledFor(logging.WARNING)
        assert os.environ["TRANSFORMERS_VERBOSITY"] == "error"  # a first import inside: the same
    assert tl.get_verbosity() == logging.INFO and config.isEnabledFor(logging.INFO)
    assert "TRANSFORMERS_VERBOSITY" not in os.environ
    tl.set_verbosity(logging.WARNING)
