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
import time
from typing import Any, NamedTuple

# What the server imports before forking: the rank's whole import graph (torch, the engine, the
# strategies' common modules), hydra.utils (every rank's `_target_` builds instantiate through it:
# ~50 ms per rank, paid here once), numpy.random (seed_everything; torch does not import it), DCP,
# which a rank imports at its first save or load (checkpoint.manager defers it: a rank forked from
# here has it already), and torch._dynamo: every rank imports it (~0.4-0.9 CPU-s) whether or not it
# compiles, since building an optimizer (`add_param_group`) and its every step (`_use_grad`: a
# `torch._dynamo.graph_break()`) do, so it is imported once per node here rather than once per rank.
# Never the user's modules. This module first: SERVER_ENV is the server's own environment.
PRELOAD = [
    "disttrain.launch.forkserver",
    "disttrain.worker",
    "hydra.utils",
    "numpy.random",
    "torch.distributed.checkpoint",
    "torch._dynamo",
]

# The server's environment when it imported this module (in a rank: before the agent's keys).
SERVER_ENV = dict(os.environ)

START_METHOD = "forkserver"


def warm_up(cfg: dict[str, Any] | None = None) -> None:
    """Start this process's fork server with the rank modules preloaded (idempotent, returns at once)."""
    from multiprocessing import forkserver

    from disttrain.launch.environ import patched_environ

    ctx = multiprocessing.get_context(START_METHOD)
    ctx.set_forkserver_preload(preload(cfg))
    # The server runs `python -c ...`, which would put the cwd first on sys.path (Python 3.11 does
    # not apply the parent's sys.path to the server): a stray torch.py or yaml.py in the cwd would
    # be imported. PYTHONSAFEPATH keeps it out; each rank gets the launcher's sys.path when forked.
    with patched_environ({"PYTHONSAFEPATH": "1"}):
        forkserver.ensure_running()
    if not _STOP_AT_EXIT:
        atexit.register(stop)
        _STOP_AT_EXIT.append(stop)


def preload(cfg: dict[str, Any] | None = None) -> list[str]:
    """The modules the server imports for `cfg`'s ranks: the same for every run (see PRELOAD)."""
    return list(PRELOAD)


_STOP_AT_EXIT: list[Any] = []


def stop(timeout: float = 5.0) -> None:
    """End the fork server and multiprocessing's resource tracker now, and reap them (at exit).

    Each exits by itself once the pipe this process holds closes, but only after this process is
    gone: a caller that waits for the CLI would see them linger a moment. Closed and reaped here,
    the CLI leaves no process when it exits. The stdlib's own `_stop` methods wait without a bound
    (a hung holder of the tracker's pipe would block the exit), hence these private attributes,
    kept here; a server that has not exited within `timeout` is left to exit by itself."""
    from multiprocessing import forkserver, resource_tracker

    holders: tuple[tuple[Any, str, str], ...] = (
        (getattr(forkserver, "_forkserver", None), "_forkserver_alive_fd", "_forkserver_pid"),
        (getattr(resource_tracker, "_resource_tracker", None), "_fd", "_pid"),
    )
    for obj, fd_name, pid_name in holders:
        fd, pid = getattr(obj, fd_name, None), getattr(obj, pid_name, None)
        if fd is None or pid is None:
            continue
        with contextlib.suppress(OSError):
            os.close(fd)
        setattr(obj, fd_name, None)
        deadline = time.monotonic() + timeout
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(pid, os.WNOHANG) == (0, 0) and time.monotonic() < deadline:
                time.sleep(0.01)
        setattr(obj, pid_name, None)
        if fd_name == "_forkserver_alive_fd":
            setattr(obj, "_forkserver_address", None)  # noqa: B010 (private: see above)


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


def rank_entry(
    entry: str, run_dir: str, launcher_env: dict[str, str], stdio: LauncherStdio | None = None
) -> None:
    """A forked rank: the launcher's environment, stdout and stderr, then `entry.run(run_dir)` as
    `python -m entry` would.

    Exit codes match `disttrain.dist.rank_main`: a ConfigError is 2 (its paragraph is in the error
    file torchelastic's @record wrote), a signal stop exits as the signal would."""
    from torch.distributed.elastic.multiprocessing.errors import record

    from disttrain.config.errors import ConfigError

    if stdio is not None:
        stdio.install()
    detach_from_server()
    environ = rank_environment(launcher_env)
    os.environ.clear()
    os.environ.update(environ)
    os.environ["DISTTRAIN_RANK_PARENT"] = str(os.getppid())  # the server: PDEATHSIG's parent
    try:
        record(importlib.import_module(entry).run)(run_dir)
    except ConfigError:
        raise SystemExit(2) from None


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


def launcher_alive(launcher: int) -> bool:
    """Whether the launcher lives: it is this rank's parent, or (a rank forked from the launcher's
    fork server, launch/forkserver.py) a live, non-zombie process."""
    if os.getppid() == launcher:
        return True
    if not os.environ.get("DISTTRAIN_RANK_PARENT"):
        return False
    return proc_stat(launcher) is not None


# ------------------------------------------------------------------------------ finding the ranks
class ProcStat(NamedTuple):
    """The fields of /proc/PID/stat that the launcher and the tests read."""

    pid: int
    comm: str  # the process name (15 bytes at most; may hold spaces and parentheses)
    state: str  # R, S, D, T, Z (zombie), X (dead), ...
    ppid: int
    pgrp: int  # the process group


def proc_stat(pid: int) -> ProcStat | None:
    """Process `pid` as Linux /proc/PID/stat shows it; None once it has gone or is a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
        # The name sits in parentheses and may itself hold ") ": the fields follow the last ')'.
        head, tail = stat.rsplit(")", 1)
        state, ppid, pgrp = tail.split()[:3]
        proc = ProcStat(int(pid), head.split("(", 1)[1], state, int(ppid), int(pgrp))
    except (OSError, ValueError, IndexError):
        return None
    return None if proc.state in ("Z", "X") else proc


def live_processes() -> list[ProcStat]:
    """Every process on this machine that is neither a zombie nor dead (Linux /proc)."""
    pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    return [proc for proc in map(proc_stat, pids) if proc is not None]


RANK_NAME = "disttrain r{rank}"  # the process name (Linux comm, 15 bytes) a rank gives itself
RANK_TITLE = "disttrain rank {rank}/{world} {run_dir}"  # its command line (ps aux, top -c, htop, py-spy)


def name_process(rank: int, world: int | None = None, run_dir: str | None = None) -> None:
    """Name this rank's process `disttrain rN` (what `ps -o comm`, top and the kernel show) and, given
    `world` and `run_dir`, title its command line `disttrain rank R/W RUN_DIR` (`set_title`): a
    forked rank's command line would otherwise be the fork server's (`python -c from
    multiprocessing.forkserver import main ...`), the same for every rank of every run."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return
    if world is not None and run_dir is not None:
        set_title(RANK_TITLE.format(rank=rank, world=world, run_dir=run_dir))
    try:
        name = RANK_NAME.format(rank=rank).encode()[:15]
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(15, ctypes.c_char_p(name), 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        return


def set_title(title: str) -> bool:
    """Write `title` over this process's command line, as setproctitle(3), nginx and PostgreSQL do.

    Linux shows a process's command line (/proc/PID/cmdline) straight from the memory the kernel put
    its argv strings in at exec, between the `arg_start` and `arg_end` addresses of /proc/self/stat.
    Python keeps its own copies (sys.argv, sys.orig_argv), so that memory is free to overwrite: the
    title, truncated to fit (never past `arg_end`, never into the environment behind it), then NULs
    to the end, so the last byte stays the NUL that tells the kernel the area holds no more. A
    forked rank's area is its own copy of the fork server's (copy-on-write): the server's stays.
    False (nothing written) where the addresses cannot be read. Linux only."""
    import ctypes

    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        # proc(5): arg_start and arg_end are fields 48 and 49; the text after ')' starts at field 3.
        start, end = int(fields[48 - 3]), int(fields[49 - 3])
    except (OSError, ValueError, IndexError):
        return False
    size = end - start
    if start <= 0 or size < 2:
        return False
    text = title.encode(errors="replace").replace(b"\0", b" ")[: size - 1]
    ctypes.memmove(start, text + b"\0" * (size - len(text)), size)
    return True


def read_title(pid: int) -> str | None:
    """Process `pid`'s command line with its arguments joined by spaces (None once it has gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return b" ".join(arg for arg in raw.split(b"\0") if arg).decode(errors="replace")


def live_ranks(run_dir: str | os.PathLike[str]) -> list[dict[str, int]]:
    """[{rank, world, pid}] of this machine's live rank processes of the run in `run_dir`, by their
    command-line titles (`name_process`), by rank. Linux /proc; nothing elsewhere."""
    from pathlib import Path

    want = Path(run_dir).resolve()
    prefix = RANK_TITLE.split("{", 1)[0]
    found = []
    for proc in live_processes():
        title = read_title(proc.pid)
        if not title or not title.startswith(prefix):
            continue
        rank_world, _, path = title[len(prefix) :].partition(" ")
        rank, _, world = rank_world.partition("/")
        if rank.isdigit() and world.isdigit() and path and Path(path).resolve() == want:
            found.append({"rank": int(rank), "world": int(world), "pid": proc.pid})
    return sorted(found, key=lambda r: (r["rank"], r["pid"]))


def rank_pids(launcher: int) -> dict[int, int]:
    """{rank: pid} of the live ranks below process `launcher` (Linux /proc; by their process name)."""
    live = live_processes()
    parents = {p.pid: p.ppid for p in live}
    names = {p.pid: p.comm for p in live}
    found = {}
    prefix = RANK_NAME.format(rank="")
    for pid, comm in names.items():
        if not comm.startswith(prefix) or not comm[len(prefix) :].isdigit():
            continue
        up, seen = parents.get(pid), 0
        while up and up != launcher and seen < 64:
            up, seen = parents.get(up), seen + 1
        if up == launcher:
            found[int(comm[len(prefix) :])] = pid
    return found
