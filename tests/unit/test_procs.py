"""procs.name_process: what `ps -o comm` and `ps aux` show for a rank (issue 39: through setproctitle)."""

from __future__ import annotations

import os
import sys

import pytest

from disttrain.procs import name_process, proc_stat, read_title


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_a_rank_names_and_titles_its_process() -> None:
    """In a forked child (pytest keeps its own title): the name is `disttrain rN` (15 bytes at most,
    not the title's first 15), the command line the rank title, however long the run dir."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            name_process(7, 8, "/tmp/a run dir/" + "x" * 300)
            os.write(write, f"{proc_stat(os.getpid()).comm}\n{read_title(os.getpid())}".encode())  # type: ignore[union-attr]
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        comm, title = f.read().split("\n", 1)
    os.waitpid(pid, 0)
    assert comm == "disttrain r7"
    assert title.startswith("disttrain rank 7/8 /tmp/a run dir/xxx")


# A rank forked from the fork server, in a fresh interpreter (setproctitle untouched until then):
# what rank_entry does in that order, then the title it got, from /proc.
FORKED_RANK = """
import os
from disttrain.procs import name_process, proc_stat, read_title, ready_title

launcher = {"PATH": os.environ["PATH"], "DISTTRAIN_X": "y" * 64}
pid = os.fork()
if pid == 0:
    ready_title()  # without it: the name, but the command line of `python -c`
    os.environ.clear()
    os.environ.update(launcher)
    name_process(1, 2, "/runs/a")
    print(proc_stat(os.getpid()).comm, read_title(os.getpid()), sep="|", flush=True)
    os._exit(0)
os.waitpid(pid, 0)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_a_rank_that_rewrites_its_environment_keeps_its_title() -> None:
    """Issue 39: through setproctitle, a forked rank that replaced its environment (rank_entry:
    the launcher's variables) before its first setproctitle call kept the server's command line
    and name, so the launcher and `disttrain show` did not find it. `ready_title` first, as
    rank_entry and spawn's rank do, and the title holds."""
    import subprocess

    said = subprocess.run([sys.executable, "-c", FORKED_RANK], capture_output=True, text=True, timeout=60)
    assert said.stdout == "disttrain r1|disttrain rank 1/2 /runs/a\n", said.stdout + said.stderr
