"""`python -m disttrain.launch.slurm_node RUN_DIR`: one node of a `launcher=slurm` job.

Reads the frozen config, takes node rank and master address from SLURM, launches this node's
ranks with torchrun. SIGTERM (preemption, scancel) and SIGUSR1 (the time-limit warning) make the
ranks checkpoint; after SIGUSR1 node 0 requeues the job (`scontrol requeue`), and a requeued job
(by us, or by Slurm after a preemption) resumes from that checkpoint (resume=auto).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from disttrain.config.errors import ConfigError
from disttrain.config.run import Run
from disttrain.launch import LaunchError, launch
from disttrain.launch.slurm import check_allocation, first_host
from disttrain.rundir import read_config, run_status

_SIGNALLED: list[int] = []


def node_config(run_dir: Path) -> Run:
    """The frozen run with this node's rank and the allocation's master (SlurmLauncher.launch
    runs torchrun's agent on it)."""
    run = Run.of(read_config(run_dir))
    check_allocation(run)
    node: dict[str, Any] = {"node_rank": int(os.environ.get("SLURM_NODEID", "0"))}
    if run.world.nodes > 1:
        node.update(master_addr=first_host(), master_port=run.world.master_port or 29500)
    return run.updated(node)


def _forward_usr1() -> None:
    """Slurm's warning before the time limit: stop like a preemption (SIGTERM: ranks checkpoint).

    Slurm signals every process of the step, and SIGUSR1 would kill a rank outright. So SIGUSR1
    stays blocked here and in the ranks (a blocked mask is inherited across exec); this thread
    takes it and sends this launcher SIGTERM, which torchrun forwards to the ranks: they save.
    """
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})

    def wait() -> None:
        signal.sigwait({signal.SIGUSR1})
        _SIGNALLED.append(signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=wait, name="disttrain-sigusr1", daemon=True).start()


def requeue() -> None:
    """Node 0, after SIGUSR1 (the time limit is near): put the job back in the queue."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job or os.environ.get("SLURM_NODEID", "0") != "0":
        return
    sys.stderr.write(f"disttrain: requeueing SLURM job {job}; it resumes from the latest checkpoint\n")
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        subprocess.run(["scontrol", "requeue", job], timeout=60, check=False)


def main(argv: list[str]) -> int:
    run_dir = Path(argv[0]).resolve()
    _forward_usr1()
    try:
        run = node_config(run_dir)
    except ConfigError as exc:
        sys.stderr.write(f"disttrain: {exc}\n")
        return 2
    status = run_status(run_dir) if run.world.node_rank == 0 else contextlib.nullcontext()
    try:
        with status:
            launch(run, run_dir)
    except LaunchError as exc:
        sys.stderr.write(f"disttrain: {exc}\n")
        # Only our own time-limit warning requeues: SIGTERM alone is scancel (stay stopped) or a
        # preemption, which Slurm requeues itself (the script has --requeue) with PreemptMode=REQUEUE.
        if _SIGNALLED:
            requeue()
        return exc.exit_code
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
