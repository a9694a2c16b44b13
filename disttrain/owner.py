"""One owner per run dir and per checkpoint dir, for the launcher's whole life.

A status.json `running` record is written only after the checks and the freeze (1-2 s), so two
launchers started together both passed the old check and trained into one run dir; two runs
sharing a `checkpoint.dir` resumed and overwrote each other's checkpoints. Here the launcher takes
an exclusive `flock` on `<folder>/.lock` before its checks and holds it until it exits (the kernel
drops it when the process dies, even by SIGKILL: no stale lock). The lock file names its holder
(pid, host, run dir) for the error message.

A checkpoint dir also records its owner (`owner.json`: the run dir whose checkpoints it holds), so
a new run never resumes or prunes another run's checkpoints unless `resume=` names them.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import stat
import time
from pathlib import Path
from typing import Any

from disttrain.config.errors import ConfigError

LOCK = ".lock"
OWNER = "owner.json"
# Every rank of a run holds a shared lock on this file of its run dir for its whole life: the
# launcher's own lock dies with the launcher, its ranks do not (they save a signal checkpoint
# first). A launcher taking the run dir waits for them (review 2026-11-28-reliability D6).
RANKS = ".ranks.lock"
RANKS_WAIT_S = 120.0  # at most: a signal checkpoint of a killed launcher's ranks, then a refusal

_HELD: dict[Path, int] = {}  # folder -> the open, locked file: held until release_all or exit
_UNLOCKED: set[str] = set()  # object-store checkpoint dirs this command was warned about


def holder(folder: Path) -> dict[str, Any]:
    """What the lock file says about its holder ({} when unreadable)."""
    try:
        fd = os.open(folder / LOCK, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return {}
    try:
        data = json.loads(os.read(fd, 4096) or b"{}")
    except (OSError, ValueError):
        return {}
    finally:
        os.close(fd)
    return data if isinstance(data, dict) else {}


def hold(folder: Path, run_dir: Path, key: str, what: str) -> None:
    """Lock `folder` for this process (idempotent), or a ConfigError naming the live holder."""
    folder = folder.absolute()
    if folder in _HELD:
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            key, str(folder), f"a {what} this user can create", f"{exc.strerror or exc}: choose another."
        ) from None
    fd = _locked(folder / LOCK, key, what)
    if fd is None:
        owner = holder(folder)
        who = (
            f"process {owner.get('pid')} on {owner.get('host')} ({owner.get('run_dir')})"
            if owner
            else "another disttrain process"
        )
        raise ConfigError(
            key,
            str(folder),
            f"a {what} no other disttrain launcher is using",
            f"{who} holds it now; two launchers there would overwrite each other's checkpoints and "
            "records. Wait for it to end, or stop it (kill -TERM PID saves a checkpoint), or choose "
            "another folder.",
        )
    record = {"pid": os.getpid(), "host": socket.gethostname(), "run_dir": str(run_dir), "since": time.time()}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)
    _HELD[folder] = fd
    _wait_for_ranks(folder, key, what)


def rank_lock(run_dir: Path) -> int | None:
    """A rank's shared lock on `run_dir`'s RANKS file: the open descriptor, held until the rank
    closes it or ends (None where the file system has no flock, or the file is not a regular one)."""
    flags = (
        os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
    )
    try:
        fd = os.open(run_dir / RANKS, flags, 0o666)
    except OSError:
        return None
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            fcntl.flock(fd, fcntl.LOCK_SH)  # a launcher's probe holds it exclusively only for a moment
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def _wait_for_ranks(folder: Path, key: str, what: str) -> None:
    """Wait (RANKS_WAIT_S at most) while ranks of an earlier launcher of `folder` still live; then
    a ConfigError naming their pids. New ranks beside them would delete their save in progress and
    train the same steps into the same checkpoints."""
    path = folder / RANKS
    try:
        fd = os.open(
            path, os.O_RDWR | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
        )
    except FileNotFoundError:
        return  # no rank ever ran here
    except OSError:
        _refuse_planted(path, key, what)
        return
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            _refuse_planted(path, key, what)
        deadline = time.monotonic() + RANKS_WAIT_S
        for waited in range(1_000_000):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return  # closing the descriptor below drops the probe's lock
            except BlockingIOError:
                pass
            pids = " ".join(map(str, lock_holders(fd))) or "?"
            if time.monotonic() > deadline:
                raise ConfigError(
                    key,
                    str(folder),
                    f"a {what} where no rank of an earlier launcher still runs",
                    f"rank process(es) {pids} of an earlier launcher there still run after "
                    f"{RANKS_WAIT_S:.0f} s (their launcher ended; they may be saving). New ranks beside "
                    f"them would delete their save and train the same steps. Wait for them to exit, or "
                    f"stop them (kill -TERM {pids} saves a checkpoint), then repeat the command.",
                )
            if waited == 0:
                import sys

                sys.stderr.write(
                    f"disttrain: waiting for rank process(es) {pids} of an earlier launcher of {folder} "
                    f"to exit (a save in progress; at most {RANKS_WAIT_S:.0f} s)\n"
                )
            time.sleep(0.2)
    finally:
        os.close(fd)


def lock_holders(fd: int) -> list[int]:
    """The pids holding a flock on `fd`'s file (Linux's /proc/locks; [] elsewhere)."""
    st = os.fstat(fd)
    pids: list[int] = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/locks").read_text().splitlines():
            fields = line.split()
            # "1: FLOCK  ADVISORY  READ 12345 fd:01:1234567 0 EOF" (a waiter's line has "->" first)
            if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5].rsplit(":", 1)[-1] == str(st.st_ino):
                with contextlib.suppress(ValueError):
                    if int(fields[4]) not in pids and int(fields[4]) > 0:
                        pids.append(int(fields[4]))
    return sorted(pids)


def _locked(path: Path, key: str, what: str) -> int | None:
    """An open, flock-ed `path` (None: someone else holds it). The lock file is removed on release,
    so a file just opened may be one its holder is removing: lock, then check that the path still
    names the locked file, else take the new one (the usual pattern for removable lock files)."""
    flags = (
        os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
    )
    for _ in range(100):
        _refuse_planted(path, key, what)
        try:
            fd = os.open(path, flags, 0o666)
        except OSError as exc:
            _refuse_planted(path, key, what)  # planted between the look and the open
            raise ConfigError(
                key,
                str(path.parent),
                f"a {what} this user can write",
                f"{exc.strerror or exc}: choose another.",
            ) from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            _refuse_planted(path, key, what)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return None
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False))
        except OSError:
            same = False
        if same:
            return fd
        os.close(fd)
    raise ConfigError(key, str(path.parent), f"a {what} with a stable {LOCK}", "retry the command.")


def _refuse_planted(path: Path, key: str, what: str) -> None:
    """A lock file that is not a regular file (a symbolic link, FIFO, folder, device) was put there
    by someone: disttrain makes only regular ones. Never opened through (a FIFO would block, a link
    would write its target): one paragraph naming it (review 2026-11-28-reliability D15)."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return  # not there (yet): the open creates a regular file
    if stat.S_ISREG(mode):
        return
    kind = (
        "a symbolic link"
        if stat.S_ISLNK(mode)
        else "a FIFO"
        if stat.S_ISFIFO(mode)
        else "a directory"
        if stat.S_ISDIR(mode)
        else "a socket or device file"
    )
    raise ConfigError(
        key,
        str(path.parent),
        f"a {what} whose {LOCK} is disttrain's lock file (a regular file) or absent",
        f"{path} is {kind}, which disttrain never makes (someone put it there; it was left as it "
        f"is). Look at it, remove it (rm -r {path}), and repeat the command.",
    )


def unlocked(url: str) -> None:
    """A `checkpoint.dir` in an object store takes no lock: said once per command. A lock object
    there (S3's create-if-absent put) would not end with its holder as a `flock` does: a killed
    launcher's object would refuse every later run until someone deleted it by hand."""
    if url in _UNLOCKED:
        return
    _UNLOCKED.add(url)
    import sys

    sys.stderr.write(
        f"disttrain: warning: checkpoint.dir={url} is in an object store, where disttrain holds no "
        "lock (a local folder's lock ends with its launcher; an object would outlive a killed one): "
        "a second run writing this prefix at the same time would mix its checkpoints with this "
        "run's and prune them. HINT: give each run a prefix of its own (e.g. the run's name at "
        "the end of checkpoint.dir).\n"
    )


def release(folder: Path) -> None:
    """Drop this process's lock of `folder` (and its lock file), if it holds one."""
    fd = _HELD.pop(folder.absolute(), None)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.unlink(folder.absolute() / LOCK)  # while still locked, as release_all
        with contextlib.suppress(OSError):
            os.close(fd)


def release_all() -> None:
    """Drop every lock this process holds, and its lock file: a finished command leaves nothing in
    the folder (the CLI's end; in-process tests run several commands in one process)."""
    for folder, fd in _HELD.items():
        with contextlib.suppress(OSError):
            os.unlink(folder / LOCK)  # while still locked: nobody can hold a file about to vanish
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()
    _UNLOCKED.clear()


def home_run_dir(directory: Path) -> Path | None:
    """The run dir whose own default checkpoint folder `directory` is (`RUN/checkpoints`, a
    config.yaml beside it), else None. Such a run wrote no owner.json and locked only its run dir
    (review 2026-11-28-reliability D3)."""
    parent = directory.absolute().parent
    return parent if directory.name == "checkpoints" and (parent / "config.yaml").is_file() else None


def claim_checkpoints(directory: Path, run_dir: Path, resume: Any) -> None:
    """A new run into `checkpoint.dir`: refuse another run's checkpoints unless `resume=` names them;
    then record this run dir as their owner. Called with the folder's lock held. The owner is
    owner.json's run dir, else the run dir whose default `checkpoints/` the folder is."""
    path = directory / OWNER
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
        owner = str(saved["run_dir"]) if isinstance(saved, dict) else None
    except (OSError, ValueError, KeyError):
        home = home_run_dir(directory)
        owner = str(home) if home is not None else None
    explicit = resume not in (None, "auto", "never")
    foreign = owner is not None and Path(owner) != run_dir and not explicit
    if foreign and any(p.name.startswith("step_") for p in directory.iterdir()):
        raise ConfigError(
            "checkpoint.dir",
            str(directory),
            "a folder whose checkpoints this run wrote, or a new one",
            f"it holds the checkpoints of {owner}; this run would resume and prune them. Continue "
            f"that run with `disttrain resume {owner}`, start from its weights with "
            f"resume={directory} (its checkpoints then become this run's), or choose another "
            "checkpoint.dir.",
        )
    if owner is None or Path(owner) != run_dir:
        from disttrain.safefile import write_atomic

        write_atomic(path, (json.dumps({"run_dir": str(run_dir)}) + "\n").encode())
