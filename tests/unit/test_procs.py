"""procs.name_process: what `ps -o comm` and `ps aux` show for a rank (issue 39: through setproctitle)."""

from __future__ import annotations

import sys
from typing import Any

import pytest

# A rank forked from the fork server, in a fresh interpreter (setproctitle untouched until then):
# what rank_entry does in that order, then the title it got, from /proc.
FORKED_RANK = """
import os, sys
from disttrain.procs import name_process, proc_stat, read_title, ready_title

launcher = {"PATH": os.environ["PATH"], "DISTTRAIN_X": "y" * 64}
pid = os.fork()
if pid == 0:
    ready_title()  # without it: the name, but the command line of `python -c`
    os.environ.clear()
    os.environ.update(launcher)
    name_process(1, 2, sys.argv[1])
    print(proc_stat(os.getpid()).comm, read_title(os.getpid()), sep="|", flush=True)
    os._exit(0)
os.waitpid(pid, 0)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_a_rank_that_rewrites_its_environment_keeps_its_title() -> None:
    """Issue 39: through setproctitle, a forked rank that replaced its environment (rank_entry:
    the launcher's variables) before its first setproctitle call kept the server's command line
    and name, so the launcher and `disttrain show` did not find it. `ready_title` first, as
    rank_entry and spawn's rank do, and the title holds; the name is `disttrain rN` (15 bytes at
    most, not the title's first 15), the title whole however long the run dir. A fresh
    interpreter: pytest's own environment has changed by now (setproctitle would find no area)."""
    import subprocess

    run_dir = "/tmp/a run dir/" + "x" * 300
    said = subprocess.run(
        [sys.executable, "-c", FORKED_RANK, run_dir], capture_output=True, text=True, timeout=60
    )
    assert said.stdout == f"disttrain r1|disttrain rank 1/2 {run_dir}\n", said.stdout + said.stderr


def test_the_start_ups_garbage_is_freed_before_its_objects_are_frozen() -> None:
    """The launcher's checks leave garbage in cycles (with model=gpt: the dry step's model, 27
    modules and 11 MB of CPU tensors, held by the tracebacks of exceptions caught on the way).
    `collector_back` froze it with the rest of the start-up, so the launcher held it for the whole
    run (the checks of a model up to 1e9 parameters may build it on the CPU); it is freed first. A
    forked rank's `collector_back(collect=False)` scans nothing (the server's pages stay shared)."""
    import gc
    import weakref

    from disttrain.procs import collector_back

    class Garbage:
        cycle: Any

    assert gc.isenabled() and gc.get_freeze_count() == 0
    gc.disable()
    try:
        made = Garbage()
        made.cycle = made
        dead = weakref.ref(made)
        del made
        collector_back()
        assert gc.isenabled() and gc.get_freeze_count() > 1000  # this process's objects
        gc.collect()
        assert dead() is None
    finally:
        gc.unfreeze()
        gc.enable()
