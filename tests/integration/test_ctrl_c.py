"""Ctrl-C on a pseudo-terminal between the launch and the first step (issue 37): the phases whose
work crosses processes. Before the launch every phase runs in the CLI's own process and is tested
there (tests/unit/test_first_minute.py: compose, checks, model on meta, dry step, and the fork
server's shield); once the bar moves, tests/integration/test_tools.py (`_interrupt_a_run`)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from disttrain.procs import live_ranks

from .conftest import CLI, QUICK, find_run_dirs
from .terminal import Terminal

pytestmark = pytest.mark.slow

# What a C++ stack (torch's c10 errors, a std::terminate) or a Python one looks like on stderr.
STACKS = re.compile(r"Traceback|Exception raised from|frame #\d|terminate called|c10::")


def _titled(tmp_path: Path) -> bool:
    """Both ranks of the run under `tmp_path` are up in /proc under their titles."""
    return any(len(live_ranks(d)) == 2 for d in find_run_dirs(tmp_path))


@pytest.mark.timeout(300)
def test_ctrl_c_while_the_ranks_start_is_one_paragraph_exit_130_and_no_rank_left(tmp_path: Path) -> None:
    """The launch phase: both ranks exist (their titles in /proc: an event, no sleep) and have not
    said `ranks up` (they are joining the process group, in C++). SIGINT to the terminal's process
    group: exit 130 at once, one message, no stack, no rank or server left, the run dir marked
    interrupted. A rank whose peer had exited on KeyboardInterrupt sat in `init_process_group`
    until torch's agent SIGKILLed it after launcher.stop_grace_s (120 s): the prompt came back two
    minutes late. With stop_grace_s=100 a late exit is told apart from the fix's."""
    cmd = [CLI, "train", "threads_per_rank=1", "backend=gloo", *QUICK, "trainer.max_steps=100000"]
    term = Terminal([*cmd, "name=ctrlc", "launcher.stop_grace_s=100"], tmp_path)
    try:
        assert term.read(lambda text: _titled(tmp_path), 200), term.text[-3000:]
        rc = term.ctrl_c(seconds=90)
        left = term.leftovers()
    finally:
        term.close()
    err = term.text
    (run_dir,) = find_run_dirs(tmp_path)
    assert rc == 130 and not STACKS.search(err), err[-3000:]
    assert left == [] and live_ranks(run_dir) == [], (left, err[-2000:])
    # One message, last: the CLI's line, or the launch error's where torch's agent took the
    # signal (with its log and run dir lines); nothing from the ranks after it.
    lines = [line for line in err.splitlines() if line.strip()]
    (at,) = [i for i, line in enumerate(lines) if line.startswith("disttrain: interrupted")]
    said = re.fullmatch(r"disttrain: interrupted (\(SIGINT\) during launch 2 ranks|by SIGINT: .+)", lines[at])
    assert said and [line.split(":")[0] for line in lines[at + 1 :]] in ([], ["  log", "  run dir"]), err
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "interrupted" and status["ended"] >= status["started"], status
    assert not (run_dir / "logs" / ".status_line").exists()  # the live line's hand-over flag
    assert not list(run_dir.rglob("*.tmp")) and not (run_dir / "checkpoints").exists()
