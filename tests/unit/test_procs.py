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
