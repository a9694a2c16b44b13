"""torchrun (torch.distributed.run / elastic): one agent per node starts `nproc_per_node` ranks."""

from __future__ import annotations

import json
import math
import os
import signal
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from disttrain.launch.base import Launcher
from disttrain.launch.errors import (
    LaunchError,
    error_summary,
    exit_code_message,
    forced_message,
    is_secondary,
    stopped_message,
)
from disttrain.launch.forkserver import (
    START_METHOD,
    LauncherStdio,
    launcher_env,
    rank_entry,
    warm_up,
)

if TYPE_CHECKING:
    from disttrain.config.run import Run


def launch_config(run: Run, run_dir: Path) -> Any:
    from torch.distributed.launcher.api import LaunchConfig

    from disttrain.launch.address import endpoint, local_address
    from disttrain.launch.multinode import node_bounds

    single = run.world.nodes == 1
    launcher = run.launcher
    backend = "c10d"
    if single:
        rdzv = (
            "127.0.0.1:0" if not run.world.master_port else f"{run.world.master_addr}:{run.world.master_port}"
        )
        local_addr: str | None = "127.0.0.1"
        if run.world.master_addr in ("127.0.0.1", "localhost"):
            from disttrain.launch.loopback import register_backend

            backend = register_backend()  # c10d, with its stores bound to 127.0.0.1 only
    else:
        host, port = endpoint(run)
        rdzv, local_addr = f"{host}:{port}", local_address(host, port)
    min_nodes, max_nodes = node_bounds(run)
    return LaunchConfig(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=run.world.nproc_per_node,
        # Multi-node: one id every node derives alike (the run name); the store is this run's own.
        run_id=f"disttrain-{uuid.uuid4().hex[:8]}" if single else f"disttrain-{run.name}",
        role="disttrain",
        rdzv_endpoint=rdzv,
        rdzv_backend=backend,
        # Multi-node: node 0's roll call already hosts the store, every agent is its client.
        rdzv_configs={
            "timeout": int(launcher.rdzv_timeout),
            "last_call_timeout": int(launcher.rdzv_last_call),  # >= 1: checked before launch
            "is_host": single and run.world.node_rank == 0,
        },
        max_restarts=launcher.max_restarts,
        monitor_interval=launcher.monitor_interval,
        start_method=START_METHOD,  # ranks fork from the warm server (launch/forkserver.py)
        local_addr=local_addr,
        # SIGTERM/SIGINT: the ranks finish their step and save; SIGKILL only after this (torch's 30 s
        # default is shorter than one save of a large model).
        shutdown_timeout=math.ceil(launcher.stop_grace_s),
    )


class TorchrunLauncher(Launcher):
    """torch's elastic agent starts this node's ranks (one agent per node; c10d rendezvous)."""

    def prestart(self, run: Run) -> None:
        warm_up(run)

    def launch(self, run: Run, run_dir: Path, entry: str) -> None:
        launch_torchrun(run, run_dir, entry)


# torch's launcher loggers: the elastic agent's (shutdown on a signal, "Closing process N via
# signal SIGINT", a failed rank's traceback) and the process context's ("Terminating process N").
TORCH_LAUNCH_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")


def launch_torchrun(run: Run, run_dir: Path, entry: str = "disttrain.worker") -> None:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import elastic_launch

    from disttrain.observe.log import library_log_into
    from disttrain.rundir import RunDir

    started = time.time()
    store = None
    if run.world.nodes > 1:
        from disttrain.launch.multinode import roll_call

        store = roll_call(run, run_dir)  # config check + wait for the nodes; node 0 hosts the store
    signals = SignalCount()
    try:
        warm_up(run)  # started after the static checks already, unless the caller skipped prestart
        with library_log_into(RunDir(run_dir).logs, *TORCH_LAUNCH_LOGGERS), signals:  # off the console
            elastic_launch(launch_config(run, run_dir), rank_entry)(
                entry, str(run_dir), launcher_env(), LauncherStdio()
            )
    except RendezvousError as exc:
        from disttrain.launch.address import endpoint
        from disttrain.launch.multinode import RendezvousFailure

        host, port = endpoint(run)
        raise RendezvousFailure(
            f"rendezvous at master {host}:{port} failed on node {run.world.node_rank}: "
            f"{type(exc).__name__}: {exc}\n  HINT: check every node runs the same command and "
            "reaches the master address; raise launcher.rdzv_timeout for slow starts.",
            run_dir,
        ) from None
    except ChildFailedError as exc:
        watchdog = nccl_watchdog(run)
        rank, message = first_failure(exc.failures, watchdog=watchdog)
        if watchdog:
            message += stalled_places(run_dir, rank, since=started)
        raise LaunchError(rank, message, run_dir) from None
    except SignalException as exc:
        name = signal.Signals(exc.sigval).name
        # A second signal cuts the agent's wait for the ranks' save short (Ctrl-C twice).
        forced = signals.count(exc.sigval) > 1
        message = forced_message(name, run_dir) if forced else stopped_message(name, run_dir, started)
        raise LaunchError(None, message, run_dir, exit_code=128 + int(exc.sigval)) from None
    finally:
        del store  # node 0: stop serving the rendezvous only after every agent is done


class SignalCount:
    """The signals this process receives while the agent runs, counted through
    `signal.set_wakeup_fd` (the C handler writes each signal's number there, whatever the Python
    handler: torch's agent raises SignalException on SIGINT and SIGTERM, a second one while it
    waits for the ranks' save cuts that wait short). Only in the main thread (the CLI's)."""

    def __init__(self) -> None:
        self._pipe: tuple[int, int] | None = None
        self._old = -1
        self._seen = b""

    def __enter__(self) -> SignalCount:
        import threading

        if threading.current_thread() is threading.main_thread():
            self._pipe = os.pipe()
            for fd in self._pipe:
                os.set_blocking(fd, False)
            self._old = signal.set_wakeup_fd(self._pipe[1], warn_on_full_buffer=False)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pipe is None:
            return
        self._read()
        signal.set_wakeup_fd(self._old)
        for fd in self._pipe:
            os.close(fd)
        self._pipe = None

    def _read(self) -> None:
        if self._pipe is None:
            return
        try:
            while chunk := os.read(self._pipe[0], 256):
                self._seen += chunk
        except BlockingIOError:
            pass

    def count(self, signum: int) -> int:
        """How many times `signum` arrived."""
        self._read()
        return self._seen.count(bytes([signum]))


def first_failure(failures: dict[int, Any], watchdog: bool = False) -> tuple[int, str]:
    """The rank that caused the failure and its error. A rank's own exception comes first; then a
    death by a signal nobody sent on purpose (SIGSEGV, an OOM killer's or a user's SIGKILL); then
    SIGTERM deaths (the agent stops the survivors with it); last the ranks that only saw a peer
    die. Ties go by time (one-second resolution), then rank.

    `watchdog`: the ranks ran NCCL with torchrun's TORCH_NCCL_ASYNC_ERROR_HANDLING=1. A collective
    that waits past backend.timeout is then ended by NCCL's watchdog with SIGABRT (no Python
    exception, no error file) on every rank that waited, and only the rank that never joined it (hung
    in its own code) is left for the agent's SIGTERM (or SIGKILL after the grace). So a SIGABRT
    without an error file is a victim, ranked after those: the message names the watchdog."""

    def order(item: tuple[int, Any]) -> tuple[int, float, int]:
        rank, failure = item
        message = _failure_message(failure)
        if is_secondary(message):
            cls = 4
        elif watchdog and _watchdog_victim(failure):
            cls = 3
        elif failure.exitcode == -signal.SIGTERM or failure.exitcode == 128 + signal.SIGTERM:
            cls = 2
        elif not _has_error_file(failure):
            cls = 1
        else:
            cls = 0
        return cls, failure.timestamp, rank

    rank, failure = min(failures.items(), key=order)
    message = _failure_message(failure)
    victims = sorted(r for r, f in failures.items() if watchdog and r != rank and _watchdog_victim(f))
    if victims and not _watchdog_victim(failure) and not _has_error_file(failure):  # it hung, no error
        message += (
            f"; rank(s) {victims} were aborted (SIGABRT) by NCCL's watchdog after a collective waited "
            f"backend.timeout for rank {rank}, which never joined it (hung, stuck or much slower). "
            f"HINT: look at rank {rank}'s log; raise backend.timeout if a step can legitimately take "
            "that long"
        )
    return rank, message


def stalled_places(run_dir: Path, rank: int, since: float = 0.0) -> str:
    """NCCL's watchdog ended the waiting ranks without a Python exception; before it, each rank's
    hang watch wrote where it stood (logs/where_rankN.json): which waited where, where `rank` was."""
    from disttrain.engine.hangs import explain, stalled_records
    from disttrain.rundir import RunDir

    records = stalled_records(RunDir(run_dir).logs, since)
    return f". Where they stood: {explain(records, [rank])}" if records else ""


def _watchdog_victim(failure: Any) -> bool:
    """Killed by SIGABRT before Python could record an error: what NCCL's watchdog does."""
    return failure.exitcode in (-signal.SIGABRT, 128 + signal.SIGABRT) and not _has_error_file(failure)


def nccl_watchdog(run: Run) -> bool:
    """Whether the ranks' NCCL watchdog ends a timed-out collective by SIGABRT: nccl (`auto` on a
    CUDA machine) and torchrun's TORCH_NCCL_ASYNC_ERROR_HANDLING default (1; 3 also tears down)."""
    from disttrain.config.gpus import choose_backend

    backend = choose_backend(run.backend.name)
    mode = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    return "nccl" in backend and mode in ("1", "3")


def _has_error_file(failure: Any) -> bool:
    try:
        return bool(failure.error_file) and Path(failure.error_file).is_file()
    except (OSError, TypeError):
        return False


def _failure_message(failure: Any) -> str:
    """The exception recorded by the failing rank's @record error file, else its exit code."""
    try:
        data = json.loads(Path(failure.error_file).read_text())
        message = data.get("message", {})
        if isinstance(message, dict):
            return error_summary(message.get("message", "")) or str(message)
        return error_summary(str(message))
    except (OSError, ValueError, TypeError):
        return exit_code_message(failure.exitcode)
