"""torch.multiprocessing.spawn on one node; the parent hosts the rendezvous store (no port race)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import TYPE_CHECKING

from disttrain.config.errors import ConfigError
from disttrain.launch.base import Launcher
from disttrain.launch.environ import patched_environ
from disttrain.launch.errors import LaunchError, error_summary, exit_code_message
from disttrain.launch.forkserver import (
    START_METHOD,
    LauncherStdio,
    detach_from_server,
    launcher_env,
    rank_signals,
    warm_up,
)
from disttrain.procs import collector_back, ready_title

if TYPE_CHECKING:
    from disttrain.config.run import Run


class SpawnLauncher(Launcher):
    """torch.multiprocessing.spawn: the ranks of one node, children of this process."""

    def check_static(self, run: Run) -> None:
        if run.world.nodes > 1:
            raise ConfigError("launcher", "spawn", "nodes=1", "use launcher=torchrun for several nodes.")
        restarts = run.launcher.max_restarts
        if restarts > 0:
            raise ConfigError(
                "launcher.max_restarts",
                restarts,
                "0 with launcher=spawn",
                "restarts come from torchrun's elastic agent: use launcher=torchrun.",
            )

    def prestart(self, run: Run) -> None:
        warm_up(run)

    def launch(self, run: Run, run_dir: Path, entry: str) -> None:
        launch_spawn(run, run_dir, entry)


def _rank_main(
    local_rank: int, run_dir: str, entry: str, environ: dict[str, str], stdio: LauncherStdio
) -> None:
    """A rank forked from the fork server: the launcher's environment, stdout and stderr (the
    server's are older)."""
    stdio.install()
    rank_signals()
    detach_from_server()
    collector_back(collect=False)  # off since the server's first preload; its pages stay shared
    ready_title()  # before the environment is rewritten (procs.ready_title)
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(
        RANK=str(local_rank), LOCAL_RANK=str(local_rank), DISTTRAIN_RANK_PARENT=str(os.getppid())
    )
    import importlib

    try:
        importlib.import_module(entry).run(run_dir)
    except KeyboardInterrupt:  # Ctrl-C while the rank starts: its exit status, not a traceback
        raise SystemExit(128 + signal.SIGINT) from None
    from disttrain.dist import exit_rank

    exit_rank(0)  # only after success: an exception still reaches mp.spawn's error queue


def launch_spawn(run: Run, run_dir: Path, entry: str = "disttrain.worker") -> None:
    import torch.multiprocessing as mp

    from disttrain.launch.loopback import loopback_store
    from disttrain.observe.log import library_log_into
    from disttrain.rundir import RunDir

    nproc = run.world.nproc_per_node
    store = loopback_store(world_size=nproc, wait_for_workers=False)  # 127.0.0.1 only, not *:port
    updates = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",  # every rank is a client of the parent's store
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
    }
    try:
        warm_up(run)  # started after the static checks already, unless the caller skipped prestart
        # torch's "Terminating process N via signal SIGTERM" as it stops the survivors of a failed
        # rank: the launcher's own cleanup, kept in logs/launcher.log (the failure paragraph names
        # the rank that failed).
        with patched_environ(updates), library_log_into(RunDir(run_dir).logs, "torch.multiprocessing"):
            args = (str(run_dir), entry, launcher_env(), LauncherStdio())
            mp.start_processes(_rank_main, args=args, nprocs=nproc, join=True, start_method=START_METHOD)
    except mp.ProcessRaisedException as exc:
        raise LaunchError(exc.error_index, error_summary(str(exc)), run_dir) from None
    except mp.ProcessExitedException as exc:
        raise LaunchError(exc.error_index, exit_code_message(exc.exit_code), run_dir) from None
    finally:
        del store
