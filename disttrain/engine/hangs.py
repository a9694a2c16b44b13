"""When a collective hangs: where every rank stands, said in one paragraph.

The engine marks its own collective sections (`Progress.section`: a counter and three attribute
sets per step, nothing else). When a rank's collective times out (gloo raises; engine.loop._failed)
it writes its `Where` record and sets FAILED_KEY in the rendezvous store. Every rank runs a
`HangWatch` thread that polls that key (one store round trip every POLL_S); when it appears, the
thread writes this rank's Python stack (faulthandler, every thread) into the rank's log and, unless
the main thread already did, this rank's record: the engine's last section (op, sequence number,
step), the collectives torch's group issued, and the main thread's innermost frame of user or
disttrain code. So a rank that hangs in its own code (never entering the collective the others
wait in) still says where it is, from a thread, without a signal. The timed-out ranks read the
records and `explain` says which ranks wait in which collective and which rank is elsewhere.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import linecache
import logging
import sys
import sysconfig
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import torch

from disttrain.engine.signals import FAILED_KEY
from disttrain.observe.log import FILE_ONLY

log = logging.getLogger("disttrain")

WHERE_KEY = "disttrain/where"  # + /rank{r}: one rank's Where record (JSON, a few hundred bytes)


class Progress:
    """The engine's current (or last) collective section: what, which one (a sequence number
    counted alike on every rank) and at which step. Read by the hang report only."""

    __slots__ = ("inside", "op", "seq", "step")

    def __init__(self) -> None:
        self.op, self.seq, self.step, self.inside = "start", 0, 0, False

    @contextlib.contextmanager
    def section(self, op: str, step: int) -> Iterator[None]:
        self.seq += 1
        self.op, self.step, self.inside = op, step, True
        yield
        self.inside = False  # only on a normal exit: a rank whose collective raised is still in it


@dataclass
class Where:
    """Where one rank stands when a peer's collective timed out."""

    rank: int
    op: str  # the engine's section: "train step", "all_reduce(train/loss)", "validation", ...
    seq: int  # the section's sequence number (the same section has the same number on every rank)
    step: int
    inside: bool  # inside that section (False: between sections, e.g. loading data)
    issued: int  # collectives torch's default group issued on this rank (-1: unknown)
    at: str  # file:line of the innermost frame of user or disttrain code
    func: str
    code: str  # that line's source
    collective: str = ""  # the torch.distributed call it waits in, when one is on the stack
    waiting: bool = False  # its own collective timed out

    def place(self) -> str:
        code = f" `{self.code}`" if self.code else ""
        return f"{self.at} in {self.func}{code}"

    def section(self) -> str:
        state = "in" if self.inside else "after"
        return f"{state} {self.op} #{self.seq} (step {self.step})"


# ------------------------------------------------------------------------------------------ frames
_TORCH = str(Path(torch.__file__ or "torch").parent)
_STDLIB = tuple({sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]})
_HERE = __file__
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the folder holding disttrain/


def _own(filename: str) -> bool:
    """User or disttrain code: not torch, not the standard library, not this module."""
    return not (
        filename.startswith("<")
        or filename.startswith(_TORCH)
        or filename.startswith(_STDLIB)
        or filename == _HERE
    )


def short_path(filename: str) -> str:
    """disttrain's files from the package root, the user's from the working directory."""
    for root in (_PACKAGE_ROOT, str(Path.cwd())):
        if filename.startswith(root + "/"):
            return filename[len(root) + 1 :]
    return filename


def _c10d_call(frames: list[tuple[str, int, str]]) -> str:
    """The innermost torch.distributed collective on the stack (all_reduce, barrier, ...)."""
    for filename, _, func in frames:
        if filename.endswith("distributed_c10d.py") and not func.startswith("_"):
            return func
    return ""


def locate(frames: list[tuple[str, int, str]]) -> tuple[str, str, str, str]:
    """(file:line, function, source line, torch collective) of the innermost own frame of a stack
    given innermost first as (filename, line, function)."""
    collective = _c10d_call(frames)
    for filename, line, func in frames:
        if _own(filename):
            code = linecache.getline(filename, line).strip()
            return f"{short_path(filename)}:{line}", func, code[:80], collective
    return "?", "?", "", collective


def frames_of(frame: FrameType | None) -> list[tuple[str, int, str]]:
    """A live frame's stack, innermost first."""
    out = []
    while frame is not None:
        out.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return out


def frames_of_traceback(tb: TracebackType | None) -> list[tuple[str, int, str]]:
    """An exception's stack (where it was raised), innermost first."""
    out = []
    while tb is not None:
        out.append((tb.tb_frame.f_code.co_filename, tb.tb_lineno, tb.tb_frame.f_code.co_name))
        tb = tb.tb_next
    return out[::-1]


def issued_collectives() -> int:
    """The collectives torch's default group has issued here (its sequence number; -1 unknown)."""
    try:
        import torch.distributed as dist

        group = dist.distributed_c10d._get_default_group()
        return int(group._get_sequence_number_for_group())  # type: ignore[attr-defined]
    except Exception:
        return -1


# ------------------------------------------------------------------------------------------ watch
class HangWatch:
    """Per rank: the report of where this rank stands, written once a peer's collective timed out."""

    POLL_S = 0.5  # 2 store round trips a second; the report lands well inside the stragglers' grace

    def __init__(self, progress: Progress, rank: int, world_size: int, timeout_s: float = 0.0) -> None:
        self.progress, self.rank, self.world = progress, rank, world_size
        # No new section for this long: write where this rank is before backend.timeout ends
        # (NCCL's watchdog then SIGABRTs the waiting ranks: no Python runs after it).
        self.stall_s = timeout_s - max(1.0, 0.2 * timeout_s) if timeout_s > 2 else 0.0
        self._store: Any = None
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._written = False  # a record is in the store (the main thread's replaces the watcher's)
        self._dumped = False
        self._thread: threading.Thread | None = None

    def __enter__(self) -> HangWatch:
        import torch.distributed as dist

        from disttrain.dist import default_store

        if dist.is_initialized() and self.world > 1:
            self.start(default_store())
        return self

    def start(self, store: Any) -> None:
        """Watch `store` (the rendezvous store) for a peer's timeout from a thread."""
        self._store = store
        self._done.clear()
        self._thread = threading.Thread(target=self._watch, name="disttrain-hangs", daemon=True)
        self._thread.start()

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.POLL_S)
            self._thread = None

    def _watch(self) -> None:
        seen, since, stalled = self.progress.seq, time.monotonic(), False
        while not self._done.wait(self.POLL_S):
            if self.progress.seq != seen:
                if stalled and (done := self._stall_file()) is not None:
                    done.unlink(missing_ok=True)  # it moved on: a later failure must not read it
                seen, since, stalled = self.progress.seq, time.monotonic(), False
            elif self.stall_s and not stalled and time.monotonic() - since > self.stall_s:
                stalled = True
                self._stalled(time.monotonic() - since)
            try:
                if not self._store.check([FAILED_KEY]):
                    continue
            except Exception:  # the store is gone: nothing to report to
                return
            main = sys._current_frames().get(threading.main_thread().ident or 0)
            self.write(self.where(frames_of(main)), replace=False)
            self.dump_stacks("a collective timed out")
            return

    def _stalled(self, waited: float) -> None:
        """No progress for stall_s: this rank's record into its log and `logs/where_rankN.json`
        (the launcher reads those when NCCL's watchdog ended the ranks), and its stacks."""
        main = sys._current_frames().get(threading.main_thread().ident or 0)
        where = self.where(frames_of(main))
        log.error(
            "no new collective section for %.0f s: rank %d is %s at %s",
            waited,
            self.rank,
            where.section(),
            where.place(),
            extra={FILE_ONLY: True},
        )
        target = self._stall_file()
        if target is not None:
            with contextlib.suppress(OSError):
                from disttrain.safefile import write_text_atomic

                write_text_atomic(target, json.dumps(asdict(where)) + "\n")
        self.dump_stacks(f"no new collective section for {waited:.0f} s")

    def _stall_file(self) -> Path | None:
        """logs/where_rankN.json beside this rank's log file (None without a log file)."""
        log_file = next((h.baseFilename for h in log.handlers if isinstance(h, logging.FileHandler)), None)
        return Path(log_file).parent / f"where_rank{self.rank}.json" if log_file is not None else None

    def where(self, frames: list[tuple[str, int, str]], waiting: bool = False) -> Where:
        at, func, code, collective = locate(frames)
        p = self.progress
        return Where(
            self.rank,
            p.op,
            p.seq,
            p.step,
            p.inside,
            issued_collectives(),
            at,
            func,
            code,
            collective,
            waiting,
        )

    def write(self, where: Where, replace: bool = True) -> None:
        """Into the store (the peers read it) and this rank's log. `replace=False`: only if none yet."""
        with self._lock:
            if self._written and not replace:
                return
            self._written = True
        log.error(
            "hang report: rank %d is %s at %s; %d collectives issued",
            self.rank,
            where.section(),
            where.place(),
            where.issued,
            extra={FILE_ONLY: True},  # the console gets the paragraph (engine.loop._timed_out)
        )
        try:
            if self._store is not None:
                self._store.set(f"{WHERE_KEY}/rank{self.rank}", json.dumps(asdict(where)))
        except Exception:
            pass

    def dump_stacks(self, why: str) -> None:
        """Every thread's Python stack into this rank's log file (faulthandler: no lock taken)."""
        with self._lock:
            if self._dumped:
                return
            self._dumped = True
        for handler in log.handlers:
            stream = getattr(handler, "stream", None)
            if isinstance(handler, logging.FileHandler) and stream is not None:
                log.error(
                    "Python stack of every thread of rank %d (%s):", self.rank, why, extra={FILE_ONLY: True}
                )
                with contextlib.suppress(Exception):
                    handler.flush()
                    faulthandler.dump_traceback(file=stream, all_threads=True)
                    stream.flush()

    def records(self, wait_s: float = 0.0) -> dict[int, Where]:
        """Every rank's record found in the store, waiting up to `wait_s` for the missing ones."""
        found: dict[int, Where] = {}
        if self._store is None:
            return found
        deadline = time.monotonic() + wait_s
        while True:
            for r in range(self.world):
                key = f"{WHERE_KEY}/rank{r}"
                if r not in found and self._store.check([key]):
                    found[r] = Where(**json.loads(self._store.get(key)))
            if len(found) == self.world or time.monotonic() >= deadline:
                return found
            time.sleep(0.1)


def stalled_records(log_dir: Path, since: float = 0.0) -> dict[int, Where]:
    """The `where_rankN.json` records ranks wrote on a stall (HangWatch._stalled) at `since` (a
    time.time()) or later: not an earlier attempt's in the same run dir; bad files skipped."""
    found: dict[int, Where] = {}
    for path in sorted(log_dir.glob("where_rank*.json")):
        with contextlib.suppress(OSError, ValueError, TypeError):
            if path.stat().st_mtime < since:
                continue
            record = Where(**json.loads(path.read_text()))
            found[record.rank] = record
    return found


# ------------------------------------------------------------------------------------------ words
def explain(records: dict[int, Where], hung: list[int]) -> str:
    """Which ranks wait in which collective, which ranks are elsewhere and where, in sentences."""
    groups: dict[str, list[int]] = {}
    for r, w in sorted(records.items()):
        if r in hung:
            continue
        call = f"in {w.collective} " if w.collective else ""
        issued = f", {w.issued} collectives issued" if w.issued >= 0 else ""
        groups.setdefault(f"{call}{w.section()} at {w.place()}{issued}", []).append(r)
    parts = [f"rank(s) {ranks} wait {what}" for what, ranks in groups.items()]
    for r in hung:
        other = records.get(r)
        if other is None:
            parts.append(f"rank {r} did not answer (dead, stopped, or its store connection is gone)")
            continue
        issued = f", {other.issued} collectives issued" if other.issued >= 0 else ""
        parts.append(f"rank {r} is elsewhere: {other.section()} at {other.place()}{issued}")
    return "; ".join(parts)
