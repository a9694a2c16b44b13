"""Start-up phases on stderr, from Enter to the first step: what the command is doing, and for how long.

    disttrain: compose ...
    disttrain: compose 0.38 s | checks ...
    disttrain: checks 1.90 s | model on meta ...
    disttrain: model on meta 0.21 s | dry step ...
    disttrain: dry step 0.30 s | launch 2 ranks ...
    disttrain: launch 1.20 s | ranks up ...                       (rank 0 from here)
    disttrain: ranks up 0.52 s | first step 4.61 s after Enter (launch to first step 1.72 s)

Off a terminal each phase is one plain line when it starts (with the time of the one before), so a
log or a test sees each phase as it begins. On a terminal it is one live status line, rewritten ten
times a second with the running phase's time, ended by a newline before the ranks write.

The first line leaves within a few tens of milliseconds of Enter: the CLI announces `compose` before
it imports Hydra or torch. This module imports only the standard library.

Across processes: the CLI sets DISTTRAIN_ENTER_TIME (its own process start, from /proc; for a
command called in a running process, `disttrain.cli.main([...])`, the call's start) for the ranks; rank 0 announces `ranks up` and the first step. On a terminal the parent's live line is the
console's until rank 0 starts: rank 0 waits (at most HANDOVER_S) until the parent has ended it
(`handover`), so two processes never rewrite one line.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import IO

from disttrain.timing import process_start_time

# A plain phase line (off a terminal), for tools and tests that read stderr around them.
PHASE_LINE = re.compile(r"^disttrain: (?:[a-z0-9 ]+ \d+\.\d\d s \| )?[a-z0-9 ]+ \.\.\.$")

ENTER_ENV = "DISTTRAIN_ENTER_TIME"  # the CLI's process start (time.time() scale)
LIVE_ENV = "DISTTRAIN_STATUS_LINE"  # a file that exists while the parent's live line is on the terminal
TICK_S = 0.1
HANDOVER_S = 1.0
SPINNER = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"


def enter_time() -> float | None:
    """When the user pressed Enter: the CLI's process start (as the CLI handed it on), else None."""
    try:
        return float(os.environ[ENTER_ENV])
    except (KeyError, ValueError):
        return None


def _is_terminal(stream: IO[str]) -> bool:
    """A terminal that can rewrite a line (not TERM=dumb: Emacs' shell, some CI consoles)."""
    if os.environ.get("TERM") == "dumb":
        return False
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # closed
        return False


class Phases:
    """The start-up phases of one command: `start(name)` ends the phase before (its time is shown)
    and announces the next; `end(tail)` closes the line; `abort()` only ends a live line (Ctrl-C,
    an error: the message that follows starts on a line of its own)."""

    def __init__(self, stream: IO[str] | None = None, live: bool | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.live = _is_terminal(self.stream) if live is None else live
        self.done: list[tuple[str, float]] = []
        self.name: str | None = None
        self.cut: str | None = None  # the phase `abort` ended (what a Ctrl-C interrupted)
        self.began = 0.0
        self.watch: Path | None = None  # live: the flag file rank 0 writes into once it is up
        self._lock = threading.Lock()
        self._ticker: threading.Thread | None = None
        self._stop = threading.Event()
        self._frame = 0

    @property
    def active(self) -> bool:
        return self.name is not None

    def start(self, name: str) -> None:
        with self._lock:
            now = time.monotonic()
            if self.name is not None:
                self.done.append((self.name, now - self.began))
            self.name, self.began = name, now
            if self.live:
                self._draw()
            else:
                before = f"{self.done[-1][0]} {self.done[-1][1]:.2f} s | " if self.done else ""
                self._write(f"disttrain: {before}{name} ...\n")
        if self.live and self._ticker is None:
            # Kept only once started: a Ctrl-C inside `start()` (it waits for the thread) left an
            # unstarted thread that `abort` then joined (RuntimeError, a traceback for a Ctrl-C).
            ticker = threading.Thread(target=self._tick, name="disttrain-phases", daemon=True)
            ticker.start()
            self._ticker = ticker

    def end(self, tail: str = "") -> None:
        """The running phase is over: a live line gets its final text and a newline; a plain one,
        `tail` on a line of its own (when given)."""
        self._stop_ticker()
        with self._lock:
            if self.name is None:
                return
            self.done.append((self.name, time.monotonic() - self.began))
            self.name = None
            if self.live:
                self._write("\r\x1b[K" + self._text(tail) + "\n")
            elif tail:
                last, took = self.done[-1]
                self._write(f"disttrain: {last} {took:.2f} s | {tail}\n")

    def abort(self) -> None:
        """Stop announcing: a live line ends where it is (a newline), so what follows is not glued
        to it; a plain line needs nothing."""
        self._stop_ticker()
        with self._lock:
            if self.name is not None and self.live:
                self._write("\n")
            self.cut = self.name or self.cut
            self.name = None

    # -------------------------------------------------------------------------------- live line
    def _text(self, tail: str = "", running: bool = False) -> str:
        parts = [f"{name} {took:.2f} s" for name, took in self.done]
        if running and self.name is not None:
            spin = SPINNER[self._frame % len(SPINNER)]
            parts.append(f"{self.name} {spin} {time.monotonic() - self.began:.1f} s")
        if tail:
            parts.append(tail)
        return "disttrain: " + " · ".join(parts)

    def _draw(self) -> None:
        width = _columns(self.stream)
        text = self._text(running=True)
        if len(text) > width - 1:  # one terminal row: a wrapped line could not be rewritten in place
            text = "disttrain: …" + text[len(text) - (width - 13) :]
        self._write("\r\x1b[K" + text)

    def _tick(self) -> None:
        while not self._stop.wait(TICK_S):
            with self._lock:
                if self.name is None:
                    return
                self._frame += 1
                if self.watch is not None and _said_up(self.watch):
                    self._handed_over()
                    return
                self._draw()

    def _handed_over(self) -> None:
        """Rank 0 is up (it wrote into the flag file): the line is final, the console is rank 0's."""
        self.done.append((self.name or "", time.monotonic() - self.began))
        self.name = None
        self._write("\r\x1b[K" + self._text("ranks up") + "\n")
        _release()

    def _stop_ticker(self) -> None:
        self._stop.set()
        ticker, self._ticker = self._ticker, None
        if ticker is not None and ticker.is_alive() and ticker is not threading.current_thread():
            ticker.join()
        self._stop.clear()

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # a closed pipe: the phases are only news
            pass


def _said_up(flag: Path) -> bool:
    try:
        return flag.stat().st_size > 0
    except OSError:
        return True  # gone: rank 0 stopped waiting


def _columns(stream: IO[str]) -> int:
    """The terminal's width; COLUMNS, then 80, where it does not say (a new pseudo-terminal: 0)."""
    try:
        columns = os.get_terminal_size(stream.fileno()).columns
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        columns = 0
    if columns <= 0:
        try:
            columns = int(os.environ.get("COLUMNS", "80"))
        except ValueError:
            columns = 80
    return max(columns, 40)


# ------------------------------------------------------------------------------ this command's
_CURRENT: list[Phases] = []


def begin(name: str, entered: float | None = None, stream: IO[str] | None = None) -> Phases:
    """The command's phases, started with `name` (the CLI's first line); its Enter time handed on:
    `entered` (a command called in a running process: a test, a notebook), else the one this process
    was handed, else this process's start."""
    if entered is not None:
        os.environ[ENTER_ENV] = repr(entered)
    elif ENTER_ENV not in os.environ:
        started = process_start_time()
        os.environ[ENTER_ENV] = repr(started if started is not None else time.time())
    phases = Phases(stream)
    _CURRENT[:] = [phases]
    phases.start(name)
    return phases


def phase(name: str) -> None:
    """The next phase of this command, if it announces phases (a no-op elsewhere: in a rank, in
    `disttrain config`, in tests that call the checks)."""
    if _CURRENT and _CURRENT[0].active:
        _CURRENT[0].start(name)


def abort() -> str | None:
    """Ctrl-C or an error: end this command's live line, announce nothing more; the phase it was in."""
    if not _CURRENT:
        return None
    current = _CURRENT.pop()
    current.abort()
    return current.cut


def launching(logs: Path, ranks: int, in_process: bool) -> None:
    """The `launch` phase. On a terminal with ranks of their own, the live line runs until rank 0
    says it is up (`rank_up`) through a flag file in `logs`, named to the ranks by LIVE_ENV."""
    if not (_CURRENT and _CURRENT[0].active):
        return
    current = _CURRENT[0]
    if current.live and not in_process:
        logs.mkdir(parents=True, exist_ok=True)
        flag = logs / ".status_line"
        flag.write_bytes(b"")
        os.environ[LIVE_ENV] = str(flag)
        current.watch = flag
    name = f"launch {ranks} rank{'s' if ranks != 1 else ''}"
    if current.name == "launch":  # announced when the checks ended: named now, with its ranks
        current.name = name
    else:
        current.start(name)


def launched() -> None:
    """The launch returned: whatever the ranks did, this command's line is over. The phase stays
    the command's, for the CLI to name if a Ctrl-C ended it (`interrupted (SIGINT) during launch 2
    ranks`, not a bare `interrupted (SIGINT)`)."""
    if _CURRENT:
        _CURRENT[0].abort()
    _release()


def _release() -> None:
    flag = os.environ.pop(LIVE_ENV, None)
    if flag:
        with contextlib.suppress(OSError):
            os.unlink(flag)


def rank_up(stream: IO[str]) -> None:
    """Rank 0, before its first console line: the `launch` phase is over. In the launcher's own
    process (one rank) its line ends here; in a rank of its own, off a terminal, one plain line on
    `stream`; on a terminal, rank 0 says so in the flag file and waits (at most HANDOVER_S) until
    the parent has ended its live line (and removed the file)."""
    if _CURRENT and _CURRENT[0].active:
        _CURRENT.pop().end("ranks up")
        return
    launch = _launch_time()
    if enter_time() is None or launch is None:
        return
    flag = os.environ.get(LIVE_ENV)
    if not flag:
        stream.write(f"disttrain: launch {time.time() - launch:.2f} s | ranks up ...\n")
        stream.flush()
        return
    try:
        with open(flag, "ab") as f:
            f.write(b"up")
    except OSError:
        return
    deadline = time.monotonic() + HANDOVER_S
    while os.path.exists(flag) and time.monotonic() < deadline:
        time.sleep(0.01)


def first_step_line(first_step_at: float) -> str | None:
    """`first step 4.61 s after Enter (launch to first step 1.72 s)`, for rank 0's log."""
    enter, launch = enter_time(), _launch_time()
    if enter is None:
        return None
    line = f"first step {first_step_at - enter:.2f} s after Enter"
    if launch is not None:
        line += f" (launch to first step {first_step_at - launch:.2f} s)"
    return line


def _launch_time() -> float | None:
    try:
        return float(os.environ["DISTTRAIN_LAUNCH_TIME"])
    except (KeyError, ValueError):
        return None
