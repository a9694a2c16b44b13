"""disttrain.observe.log: what a rank without the console writes raw goes to its log."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
