"""Launch: the one place that chooses how ranks start — in this process, or by the configured launcher
(a `Launcher` from the registry: torchrun, spawn, slurm, k8s, or one you register).

Every path calls the same `disttrain.worker.run(run_dir)`; tools that need ranks of their own
(`disttrain bench comm`) pass another `entry` module with the same `run(run_dir)` + `__main__` shape.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from disttrain.launch.environ import patched_environ
from disttrain.launch.errors import LaunchError

if TYPE_CHECKING:
    from disttrain.config.run import Run

__all__ = ["LaunchError", "launch", "launched_externally", "prestart", "submit"]


def launched_externally() -> bool:
    """True inside a rank someone else started (`torchrun -m disttrain train ...`, `srun ...`)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def threads_per_rank(run: Run) -> int:
    return run.threads_per_rank or max(1, len(os.sched_getaffinity(0)) // run.world.nproc_per_node)


def rank_environment(run: Run) -> Any:
    """Variables every rank inherits; restored afterwards (multirun launches again)."""
    return patched_environ(
        {
            "OMP_NUM_THREADS": str(threads_per_rank(run)),
            "DISTTRAIN_LAUNCH_TIME": repr(time.time()),
            # `python -m disttrain.worker` would put the cwd first on sys.path, ahead of torch and
            # yaml (a stray yaml.py in a shared folder would run); the worker appends it instead.
            "PYTHONSAFEPATH": "1",
            "DISTTRAIN_LAUNCHER_PID": str(os.getpid()),  # a rank notices when its launcher is gone
        }
    )


WORKER = "disttrain.worker"

FLIGHT_RECORDER_ENTRIES = "2000"  # the last collectives of each group, kept in a ring (a few hundred kB)


def flight_recorder_environment(run: Run, run_dir: Path) -> dict[str, str]:
    """nccl: torch's flight recorder on, dumped on a timeout into the run's logs/ (one file per
    rank, `nccl_trace_rank_N`; read with `torchfrtrace RUN/logs -p nccl_trace_rank_`). Off for gloo, which has none. A
    value the user exported wins."""
    from disttrain.config.gpus import choose_backend
    from disttrain.rundir import RunDir

    if "nccl" not in choose_backend(run.backend.name):
        return {}
    wanted = {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": FLIGHT_RECORDER_ENTRIES,
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(RunDir(run_dir).logs / "nccl_trace_rank_"),
    }
    return {k: v for k, v in wanted.items() if k not in os.environ}


def submit(run: Run, run_dir: Path, command: list[str]) -> bool:
    """Hand the frozen run to the launcher's scheduler (sbatch, kubectl). True: it did, and the
    scheduler's nodes train (status.json is theirs); False: call `launch` here."""
    from disttrain.launch.registry import launcher_for

    return launcher_for(run).submit(run, run_dir, command)


def prestart(run: Run) -> None:
    """After the static checks: let the launcher warm up what its ranks will need (a fork server
    importing torch) while the parent runs the runtime checks. Nothing for a run in this process."""
    from disttrain.launch.registry import launcher_for

    if _in_process(run):
        return
    launcher_for(run).prestart(run)


def _in_process(run: Run) -> bool:
    return run.world.size == 1 and run.launcher.max_restarts == 0


def launch(run: Run, run_dir: Path, entry: str = WORKER) -> None:
    """Start the ranks for `run` and wait for them; raise LaunchError naming the first failure.

    `entry` is the per-rank module: it has `run(run_dir)` and runs it from `python -m entry RUN_DIR`.
    """
    from disttrain.launch.registry import launcher_for
    from disttrain.observe import phases
    from disttrain.procs import collector_back
    from disttrain.rundir import RunDir
    from disttrain.timing import mark

    mark("launch")
    collector_back()  # the program's start-up is over (cli.main)
    in_process = _in_process(run)
    phases.launching(RunDir(run_dir).logs, run.world.nproc_per_node, in_process)
    try:
        with rank_environment(run), patched_environ(flight_recorder_environment(run, run_dir)):
            if in_process:
                import importlib

                importlib.import_module(entry).run(run_dir)  # fairseq's call_main: one rank, no child
            else:
                launcher_for(run).launch(run, run_dir, entry)
    finally:
        phases.launched()
