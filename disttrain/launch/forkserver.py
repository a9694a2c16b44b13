"""Ranks forked from a warm server: torch is imported once per node, while the parent still checks.

A rank started as `python -m disttrain.worker` spends ~2 CPU-seconds importing torch and disttrain
before it can join its process group; with N ranks per node that is N imports, all after the
parent's pre-launch checks. Python's `forkserver` start method (used by torch.multiprocessing and
torch's elastic agent for function entry points) runs one server process that imports the
modules named in its preload list, then forks every child from that warm state:

- `warm_up()` starts the server right after the static checks passed (a config mistake spawns
  nothing), so its imports run on another core while the parent composes the run dir and takes
  the dry step; by the time the agent starts the ranks they only fork.
- The server imports torch and disttrain's rank modules only: never the user's code (a `_target_`
  module is imported by each rank after the fork, as before) and never CUDA (importing torch does
  not initialise it), so a fork is as clean as a fresh interpreter.
- The server is a helper, not a rank: it holds no state of the run, writes nothing, and exits when
  the launcher does (it watches a pipe the launcher holds). A failed runtime check leaves nothing.
- A forked process inherits the environment of the server, which started before the launcher set
  the ranks' variables (`launch.rank_environment`): `rank_entry` rebuilds exactly the environment a
  `python -m disttrain.worker` child would get (the launcher's, plus the agent's per-rank keys).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import multiprocessing
import os
import signal
import time
from typing import TYPE_CHECKING, Any

from disttrain.procs import collector_back, ready_title, startup_without_collector

if TYPE_CHECKING:
    from disttrain.config.run import Run

# What the server imports before forking: the rank's whole import graph (torch, the engine, the
# strategies' common modules), hydra.utils (every rank's `_target_` builds instantiate through it:
# ~50 ms per rank, paid here once), numpy.random (seed_everything; torch does not import it), DCP,
# which a rank imports at its first save or load (checkpoint.manager defers it: a rank forked from
# here has it already), and torch._dynamo: every rank imports it (~0.4-0.9 CPU-s) whether or not it
# compiles, since building an optimizer (`add_param_group`) and its every step (`_use_grad`: a
# `torch._dynamo.graph_break()`) do, so it is imported once per node here rather than once per rank;
# and TensorBoard's writer (tensorboard, protobuf, absl: ~0.08 CPU-s), which rank 0 of every run
# imports for the default `tensorboard` sink: here it is paid while the parent still checks, and
# once per server, not once per run of a sweep. Never the user's modules. This module first:
# SERVER_ENV is the server's own environment.
PRELOAD = [
    "disttrain.launch.forkserver",
    "disttrain.worker",
    "hydra.utils",
    "numpy.random",
    "torch.distributed.checkpoint",
    "torch._dynamo",
    "torch.utils.tensorboard",
]

# The server's environment when it imported this module (in a rank: before the agent's keys).
SERVER_ENV = dict(os.environ)

SERVER_FLAG = "DISTTRAIN_FORK_SERVER"  # set in the server's environment only (warm_up)
if os.environ.get(SERVER_FLAG) == "1":
    # In the server, first of its preloads: Ctrl-C reaches every process of the terminal's group,
    # and the server shields itself from it only after its preloads (torch: seconds), so a Ctrl-C
    # during the checks printed a KeyboardInterrupt traceback from its import of torch. The
    # launcher stops the server (`stop`); each rank restores the default action (`rank_signals`).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Before torch or anything else may change the environment: setproctitle finds the argv area
    # from the environment strings behind it, and every rank forked from here inherits what it
    # found (each rank titles itself, `procs.name_process`; its own copy of the area).
    ready_title()
    # The preloads (torch, the rank modules) without full collections over the growing heap. The
    # server never turns the collector on again: after its preloads it only forks, and each rank
    # turns it on for itself with the preloaded objects frozen (`rank_entry`, spawn's `_rank_main`).
    startup_without_collector()

START_METHOD = "forkserver"


def warm_up(run: Run | None = None) -> None:
    """Start this process's fork server with the rank modules preloaded (idempotent, returns at once)."""
    from multiprocessing import forkserver

    from disttrain.launch.environ import patched_environ

    ctx = multiprocessing.get_context(START_METHOD)
    ctx.set_forkserver_preload(preload(run))
    # The server runs `python -c ...`, which would put the cwd first on sys.path (Python 3.11 does
    # not apply the parent's sys.path to the server): a stray torch.py or yaml.py in the cwd would
    # be imported. PYTHONSAFEPATH keeps it out; each rank gets the launcher's sys.path when forked.
    with patched_environ({"PYTHONSAFEPATH": "1", SERVER_FLAG: "1"}):
        forkserver.ensure_running()
    if not _STOP_AT_EXIT:
        atexit.register(stop)
        _STOP_AT_EXIT.append(stop)


def preload(run: Run | None = None) -> list[str]:
    """The modules the server imports for `run`'s ranks: PRELOAD, and for peft=lora the `peft`
    package (an extra of disttrain's, not the user's code: it imports transformers, accelerate
    and torchao, seconds of CPU that every rank would pay again)."""
    return [*PRELOAD, "peft"] if run is not None and run.peft.name == "lora" else list(PRELOAD)


_STOP_AT_EXIT: list[Any] = []


def stop(timeout: float = 2.0) -> None:
    """End the fork server and multiprocessing's resource tracker now, and reap them (at exit).

    Both hold this process's stdout and stderr: a caller that reads them to their end (a pipe, a
    test, `| tee`) waits until both have exited. The server holds nothing of the run (it only
    forks), but exiting by itself (EOF on the pipe this process holds) it would first tear down
    its interpreter with torch imported: seconds after `done:`, up to 15 s on a loaded machine. So
    it is ended by SIGKILL and reaped at once. The tracker (a small interpreter without torch) exits
    by itself once every holder of its pipe is gone, after releasing what a rank leaked (named
    semaphores, shared memory): that is waited for, at most `timeout`. The stdlib's own `_stop`
    methods wait without a bound and let the server tear down, hence these private attributes,
    kept here."""
    from multiprocessing import forkserver, resource_tracker

    server: Any = getattr(forkserver, "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    if pid is not None:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
        _close_and_reap(server, "_forkserver_alive_fd", "_forkserver_pid", timeout)
        server._forkserver_address = None
    tracker = getattr(resource_tracker, "_resource_tracker", None)
    _close_and_reap(tracker, "_fd", "_pid", timeout)


def _close_and_reap(holder: Any, fd_name: str, pid_name: str, timeout: float) -> None:
    """Close `holder`'s pipe to its helper process and wait (at most `timeout`) for it to exit."""
    fd, pid = getattr(holder, fd_name, None), getattr(holder, pid_name, None)
    if fd is None or pid is None:
        return
    with contextlib.suppress(OSError):
        os.close(fd)
    setattr(holder, fd_name, None)
    deadline = time.monotonic() + timeout
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(pid, os.WNOHANG) == (0, 0) and time.monotonic() < deadline:
            time.sleep(0.005)
    setattr(holder, pid_name, None)


def rank_signals() -> None:
    """In a forked rank: Ctrl-C ends it at once, as SIGTERM does, until the engine's stop flag
    takes both signals (the server ignored SIGINT from its first preload on, and a fork keeps that).

    Not Python's KeyboardInterrupt: before its first step a rank spends its time in C++ (joining
    the process group, the first collectives), where a Python handler cannot run. A rank whose
    peer had already exited on KeyboardInterrupt sat in `init_process_group` waiting for it until
    torch's agent SIGKILLed it after `launcher.stop_grace_s` (120 s) and the prompt came back only
    then. Nothing is trained before the stop flag, so there is nothing to save."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def detach_from_server() -> None:
    """In a forked rank: drop this process's hold on the fork server's life.

    Python hands every process the server forks a copy of the pipe end whose closing tells the
    server that its last client is gone (so a child may start grandchildren through it). Ranks
    never do; if they held it, the server would outlive a launcher killed by SIGKILL and the ranks'
    parent-death signal (their parent is the server) would never come. Closed here, the server
    exits with the launcher and the kernel SIGTERMs the ranks. The stdlib offers no public call
    for this, hence the one private attribute, kept here; `_forkserver_address` is cleared too, so
    a rank that does use the forkserver start method gets a server of its own."""
    from multiprocessing import forkserver

    server: Any = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if server is None or fd is None:
        return
    with contextlib.suppress(OSError):
        os.close(fd)
    server._forkserver_alive_fd = None
    server._forkserver_address = None
    server._forkserver_pid = None


def rank_environment(launcher_env: dict[str, str]) -> dict[str, str]:
    """The launcher's environment plus what the agent set for this rank (RANK, MASTER_PORT, ...):
    what a rank started as a subprocess of the launcher would see."""
    agent = {k: v for k, v in os.environ.items() if SERVER_ENV.get(k) != v}
    return {**launcher_env, **agent}


class LauncherStdio:
    """The launcher's stdout and stderr as they are when it starts the ranks, for each forked rank.

    A rank forked from the server inherits the server's stdout and stderr: the launcher's when the
    server started. A process that runs several launches through one server (a sweep, a notebook or
    a test harness that sends each run's output somewhere else) needs every rank to write where its
    own launcher writes now, as a `python -m disttrain.worker` child would. Pickled into a rank's
    arguments while multiprocessing hands them to the server, this passes the launcher's two
    descriptors along (`multiprocessing.reduction.DupFd`: SCM_RIGHTS over the server's socket);
    `install()`, first thing in the rank, puts them in place. Pickled anywhere else it carries
    nothing (the rank keeps what it inherited)."""

    def __init__(self, fds: tuple[int | None, int | None] = (None, None)) -> None:
        self.fds = fds

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        from multiprocessing import context, reduction

        if context.get_spawning_popen() is None:
            return (LauncherStdio, ())
        return (_received_stdio, tuple(reduction.DupFd(fd) if _is_open(fd) else None for fd in (1, 2)))

    def install(self) -> None:
        import sys

        for target, fd, stream in ((1, self.fds[0], sys.stdout), (2, self.fds[1], sys.stderr)):
            if fd is None or fd == target:
                continue
            with contextlib.suppress(Exception):
                stream.flush()
            os.dup2(fd, target)
            os.close(fd)
        self.fds = (None, None)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _received_stdio(out: Any, err: Any) -> LauncherStdio:
    """In the rank, unpickling its arguments: the descriptors the server received for it."""
    return LauncherStdio(tuple(None if h is None else h.detach() for h in (out, err)))  # type: ignore[arg-type]


def rank_entry(entry: str, run_dir: str, launcher_env: dict[str, str], stdio: LauncherStdio) -> None:
    """A forked rank: the launcher's environment, stdout and stderr, then `entry.run(run_dir)` as
    `python -m entry` would.

    Exit codes match `disttrain.dist.rank_main`: a ConfigError is 2 (its paragraph is in the error
    file torchelastic's @record wrote), a signal stop exits as the signal would (a Ctrl-C before
    training too: 130, without the traceback multiprocessing would print)."""
    from torch.distributed.elastic.multiprocessing.errors import record

    from disttrain.config.errors import ConfigError

    stdio.install()
    rank_signals()
    detach_from_server()
    collector_back(collect=False)  # off since the server's first preload; its pages stay shared
    own_session()
    ready_title()  # before the environment is rewritten (procs.ready_title)
    environ = rank_environment(launcher_env)
    os.environ.clear()
    os.environ.update(environ)
    os.environ["DISTTRAIN_RANK_PARENT"] = str(os.getppid())  # the server: PDEATHSIG's parent
    try:
        record(importlib.import_module(entry).run)(run_dir)
    except ConfigError:
        raise SystemExit(2) from None
    except KeyboardInterrupt:  # Ctrl-C while the rank starts: its exit status, not a traceback
        raise SystemExit(128 + signal.SIGINT) from None


def own_session() -> None:
    """Make this forked rank the leader of a new session, as torchrun makes each rank it starts
    (`start_new_session=True`): `python -m` ranks are not in their launcher's session either.

    It decides the rank's share of the CPUs. Where the kernel's autogroup scheduler is on (most
    distributions' default), CFS divides the CPUs between sessions first and only then between the
    processes of a session: forked into the launcher's session, all of a node's ranks shared one
    session's share wherever other sessions competed (another user, a build, another run), where
    torchrun's ranks get one each. On a shared 2-core machine nanoGPT's loop under torchrun ran
    15-20 % (at load 10-15: 2x) more tokens/s than the same model through disttrain, at the same
    CPU time per step (issue 34; scripts/bench_nanogpt.py). Signals are unchanged in effect: a
    terminal's Ctrl-C reaches the launcher, whose agent sends it on to every rank (as torchrun's
    does), and the parent-death signal does not depend on the session."""
    with contextlib.suppress(OSError):  # already a process-group leader: nothing to leave
        os.setsid()


def launcher_env() -> dict[str, Any]:
    """The environment the ranks get: this process's, as the launcher set it for them."""
    return dict(os.environ)


LINGER_S = 10.0  # how long a rank that only saw a peer die waits for its launcher to notice the peer


def linger_after_a_peer_died(message: str) -> None:
    """A forked rank failing only because a peer died waits (up to LINGER_S) to be stopped.

    torch's agent reports ONE failure of ranks started as functions: the first dead process its
    poll finds (`MultiprocessContext._poll`), where a `python -m` rank's agent reports them all and
    `torchrun.first_failure` picks the cause. A peer SIGKILLed (by the OOM killer, a user) and this
    rank's "a peer rank died" are a few milliseconds apart, so one poll sees both and may name this
    rank. Waiting here lets the agent find the peer first; it then stops this rank with SIGTERM,
    which (handlers reset to the default) ends the wait at once. Only on that failure path."""
    import signal
    import time

    from disttrain.launch.errors import is_secondary

    if not os.environ.get("DISTTRAIN_RANK_PARENT") or not is_secondary(message):
        return
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    time.sleep(LINGER_S)
