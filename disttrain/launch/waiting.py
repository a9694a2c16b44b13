"""No silent waits: a node waiting at the rendezvous says what for, and how to start the others.

`disttrain train nodes=2` typed on one machine used to print one warning, then nothing until
launcher.rdzv_timeout (15 minutes). While the roll call waits (multinode.roll_call), a thread
prints after FIRST_S which node ranks are missing, at which master address and port, the timeout,
and the exact command that starts each missing node (this node's command line with its node_rank),
then one line every EVERY_S. On one host without a cluster allocation the first line says it is
a rehearsal (every node is started here, in another terminal).
"""

from __future__ import annotations

import os
import shlex
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from disttrain.config.run import Run

FIRST_S = 1.0
EVERY_S = 30.0
_ALLOCATION_VARS = ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "KUBERNETES_SERVICE_HOST")


def rehearsal(run: Run) -> bool:
    """Several nodes on this host's loopback and no cluster allocation around this process."""
    addr = str(run.world.master_addr)
    loopback = addr in ("localhost", "::1") or addr.startswith("127.")
    return loopback and not any(v in os.environ for v in _ALLOCATION_VARS)


def node_command(run_dir: Path, node_rank: int, run: Run) -> str:
    """This node's command line (command.txt) with `node_rank=K`; with `master_addr=` this node's
    address where the command has none and the other node is on another machine."""
    from disttrain.launch.address import endpoint, local_address

    try:
        argv = shlex.split((run_dir / "command.txt").read_text())
    except (OSError, ValueError):
        argv = ["disttrain", "train", f"nodes={run.world.nodes}"]
    argv = [a for a in argv if not a.lstrip("+~").startswith("node_rank=")]
    argv.append(f"node_rank={node_rank}")
    if not rehearsal(run) and not any(a.startswith("master_addr=") for a in argv):
        host, port = endpoint(run)
        argv.append(f"master_addr={local_address(host, port)}")
    return shlex.join(argv)


def waiting_line(run: Run, run_dir: Path, missing: list[int], waited: float, first: bool) -> str:
    """What this node waits for, and (first line) how to start the missing nodes."""
    from disttrain.launch.address import endpoint

    host, port = endpoint(run)
    timeout = run.launcher.rdzv_timeout
    ranks = ", ".join(map(str, missing))
    line = (
        f"disttrain: node {run.world.node_rank} of {run.world.nodes} waits for node rank(s) {ranks} at "
        f"master {host}:{port} ({waited:.0f} s of launcher.rdzv_timeout={timeout:g} s)"
    )
    if not first:
        return line + "\n"
    where = (
        "a rehearsal on this host (no cluster allocation): start each in another terminal here"
        if rehearsal(run)
        else "start each on its own machine"
    )
    commands = "".join(f"\n    {node_command(run_dir, k, run)}" for k in missing)
    return f"{line}; {where}:{commands}\n"


class Announcer:
    """A thread that says what a blocking wait waits for: first after FIRST_S, then every EVERY_S.
    `missing()` is read at each line (the roll call updates it); the wait ends the thread."""

    def __init__(self, run: Run, run_dir: Path, missing: Callable[[], list[int]]) -> None:
        self.run, self.run_dir, self.missing = run, run_dir, missing
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="disttrain-waiting", daemon=True)
        self.lines = 0

    def __enter__(self) -> Announcer:
        self._started = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(timeout=1.0)

    def _run(self) -> None:
        wait = FIRST_S
        while not self._done.wait(wait):
            missing = self.missing()
            if missing:
                waited = time.monotonic() - self._started
                sys.stderr.write(waiting_line(self.run, self.run_dir, missing, waited, first=not self.lines))
                sys.stderr.flush()
                self.lines += 1
            wait = EVERY_S
