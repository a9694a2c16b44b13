"""Processes as Linux /proc shows them: the name and title a rank gives itself, whether its
launcher lives, the ranks below a launcher. Read by the ranks (rundir's orphan record, the stop
flag's check for a dead peer), the launcher and the tests; no disttrain imports, so any layer may.
"""

from __future__ import annotations

import os
from typing import NamedTuple


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
    `world` and `run_dir`, title its command line `disttrain rank R/W RUN_DIR` (ps aux, top -c,
    htop, py-spy, `live_ranks`): a forked rank's command line would otherwise be the fork server's
    (`python -c from multiprocessing.forkserver import main ...`), the same for every rank of every
    run. Both through `setproctitle`; a forked rank's argv area is its own copy-on-write copy of
    the server's, which keeps its own title. A forked rank calls `ready_title` first."""
    import setproctitle

    if world is not None and run_dir is not None:
        setproctitle.setproctitle(RANK_TITLE.format(rank=rank, world=world, run_dir=run_dir))
    # After the title: on Linux setproctitle also names the process after the title's first 15
    # bytes; the main thread's name is the process name (/proc/PID/stat, `ps -o comm`).
    setproctitle.setthreadtitle(RANK_NAME.format(rank=rank))


def ready_title() -> None:
    """Let `setproctitle` take this process's argv and environment area now, before the process
    rewrites its environment: a rank forked from the fork server does (`os.environ.clear()`, then
    the launcher's variables), and setproctitle, first called after that, finds the environment
    strings moved away from argv and leaves the command line as it was: the server's, so the
    launcher and `disttrain show` never found the rank by its title (a hung rank outlived its
    run). setproctitle locates the argv area from the environment strings that follow it; any
    change of the environment before its first call can hide it. Taken first, the environment is
    copied away by setproctitle itself and later changes no longer matter: the fork server calls
    this as its first preload (its ranks inherit the result), a forked rank and a `python -m`
    rank again before they change theirs."""
    import setproctitle

    setproctitle.getproctitle()


def startup_without_collector() -> None:
    """Python's cyclic garbage collector off for this process's start-up (`collector_back` turns
    it on again). Importing torch, Hydra and the rank modules grows the heap from nothing to ~300k
    objects, and each 25 % of growth set off a full collection over all of it: on the default job
    1.1 CPU-s in the fork server's preloads and 0.5 s in the launcher (gc.callbacks), on the way
    to the first step. What start-up makes is modules, classes and functions that live as long as
    the process: nothing a collection would free."""
    import gc

    gc.disable()


def collector_back(collect: bool = True) -> None:
    """The collector on again after `startup_without_collector`, with the objects made so far out
    of its reach for good (`gc.freeze`). Unfrozen, they all sat in the youngest generation, and the
    first collections after start-up scanned them anyway (the launcher: 0.48 of its 0.51 s).

    `collect`: free the start-up's garbage first (one collection over it all), or it is frozen with
    the rest and held for the process's life: the launcher's checks leave some in cycles (with
    model=gpt the dry step's model, 11 MB of CPU tensors, held by the tracebacks of exceptions
    caught on the way; a model the checks build on the CPU may have up to 1e9 parameters). A rank
    forked from the fork server passes False: it shares the server's objects copy-on-write, and a
    collection would touch all their pages; the server's preloads are imports, which leave little
    garbage. A no-op in a process that never turned it off (a test, a notebook)."""
    import gc

    if gc.isenabled():
        return
    if collect:
        gc.collect()
    gc.freeze()
    gc.enable()


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
    command-line titles (`name_process`), by rank; not the processes a rank forked (DataLoader
    workers: they inherit its title). Linux /proc; nothing elsewhere."""
    from pathlib import Path

    want = Path(run_dir).resolve()
    prefix = RANK_TITLE.split("{", 1)[0]
    live = live_processes()
    titles = {proc.pid: read_title(proc.pid) for proc in live}
    found = []
    for proc in live:
        title = titles[proc.pid]
        if not title or not title.startswith(prefix) or titles.get(proc.ppid) == title:
            continue  # not a rank, or a rank's forked child (a DataLoader worker keeps its title)
        rank_world, _, path = title[len(prefix) :].partition(" ")
        rank, _, world = rank_world.partition("/")
        if rank.isdigit() and world.isdigit() and path and Path(path).resolve() == want:
            found.append({"rank": int(rank), "world": int(world), "pid": proc.pid})
    return sorted(found, key=lambda r: (r["rank"], r["pid"]))


def rank_pids(launcher: int) -> dict[int, int]:
    """{rank: pid} of the live ranks below process `launcher` (Linux /proc; by their process name):
    the rank itself, not a process it forked (a DataLoader worker inherits its name; listed after
    it, it had taken its place)."""
    live = live_processes()
    parents = {p.pid: p.ppid for p in live}
    names = {p.pid: p.comm for p in live}
    found = {}
    prefix = RANK_NAME.format(rank="")
    for pid, comm in names.items():
        if not comm.startswith(prefix) or not comm[len(prefix) :].isdigit():
            continue
        if names.get(parents[pid]) == comm:  # a rank's forked child (a DataLoader worker) keeps its name
            continue
        up, seen = parents.get(pid), 0
        while up and up != launcher and seen < 64:
            up, seen = parents.get(up), seen + 1
        if up == launcher:
            found[int(comm[len(prefix) :])] = pid
    return found
