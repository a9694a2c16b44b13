"""One rank-aware logger: rank 0 to the console (stderr), every rank to its own file in the run dir.

stdout carries only a command's result (the `done:` line, `--json`), so `disttrain train ... | tee`
and scripts that parse stdout see no log lines.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.logging import RichHandler

LOGGER = "disttrain"
console = Console(stderr=True, highlight=False)
FILE_ONLY = "file_only"  # `extra={FILE_ONLY: True}`: a record the console already shows (the bar)


class _LogFile(logging.FileHandler):
    """A rank's log file, opened for append without following a symlink planted in the run dir."""

    def _open(self) -> Any:
        from disttrain.safefile import open_append

        return open_append(Path(self.baseFilename), self.encoding or "utf-8")


class _Brief:
    """Console handlers show a failure in one line; its traceback goes to the rank's log file (the
    failure summary names that file), so stderr stays one paragraph per failure."""

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info:
            said = record.getMessage()
            record = logging.makeLogRecord(
                {**record.__dict__, "msg": f"{said} (traceback in this rank's log file)", "args": None}
            )
            record.exc_info, record.exc_text = None, None
        super().emit(record)  # type: ignore[misc]


class _BriefStream(_Brief, logging.StreamHandler):
    pass


class _BriefRich(_Brief, RichHandler):
    pass


def get_logger() -> logging.Logger:
    return logging.getLogger(LOGGER)


def setup_logging(log_dir: Path | None, rank: int, to_console: bool) -> logging.Logger:
    """Attach a per-rank file handler and, on rank 0, a console handler; replaces earlier ones."""
    log = get_logger()
    teardown_logging()
    log.setLevel(logging.INFO)
    log.propagate = False
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        fh = _LogFile(log_dir / f"rank{rank}.log", encoding="utf-8")
        fh.setFormatter(logging.Formatter(f"%(asctime)s [rank{rank}] %(levelname)s %(message)s"))
        log.addHandler(fh)
    if to_console:
        if console.is_terminal:
            ch: logging.Handler = _BriefRich(console=console, show_path=False, markup=False)
        else:
            ch = _BriefStream(console.file)  # sys.stderr, or the saved one (console_apart)
            ch.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
        ch.addFilter(lambda record: not getattr(record, FILE_ONLY, False))
        log.addHandler(ch)
    return log


def console_apart(log_dir: Path) -> None:
    """Rank 0 in a process of its own: disttrain's console (its log lines, the bar, the summary)
    keeps a duplicate of the original stderr, and file descriptor 2 then appends to rank0.log as the
    other ranks' do (stderr_into_log). So what C++ writes to fd 2 (kineto's `profiler_start`, c10d's
    stacks), Python warnings and libraries' own stderr handlers (transformers') reach the rank's log,
    not the console. The parent still summarises a failure from the logs (launch/errors.py)."""
    sys.stderr.flush()
    console.file = os.fdopen(os.dup(2), "w", buffering=1, encoding="utf-8", errors="backslashreplace")
    stderr_into_log(log_dir, 0)


LAUNCHER_LOG = "launcher.log"


@contextlib.contextmanager
def library_log_into(log_dir: Path, *names: str) -> Iterator[None]:
    """While launching: the records of torch's launcher loggers `names` (the elastic agent's
    "Received 2 death signal, shutting down workers", "Closing process N via signal SIGINT", a
    failed rank's traceback) go to `log_dir`/launcher.log instead of torch's console handler. The
    CLI's own paragraph says what happened; the file keeps torch's account. Only logging's public
    API: a handler on each logger and `propagate` off, both restored afterwards."""
    log_dir.mkdir(parents=True, exist_ok=True)
    handler = _LogFile(log_dir / LAUNCHER_LOG, encoding="utf-8", delay=True)  # made when written to
    handler.setFormatter(logging.Formatter("%(asctime)s [launcher] %(levelname)s %(name)s: %(message)s"))
    loggers = [logging.getLogger(name) for name in names]
    before = [lg.propagate for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.propagate = False  # torch's handler on `torch.distributed` writes to stderr
    try:
        yield
    finally:
        for lg, propagate in zip(loggers, before, strict=True):
            lg.removeHandler(handler)
            lg.propagate = propagate
        handler.close()


def stderr_into_log(log_dir: Path, rank: int) -> None:
    """A rank without the console (rank != 0): its file descriptor 2 appends to its log file, so
    what C++ writes there (c10d's TCPStore and gloo warnings, with their `frame #0: c10::Error`
    stacks when a peer node goes away), Python warnings and raw tracebacks land in its log instead
    of on the node's console. Rank 0's console keeps a saved copy of it (console_apart)."""
    from disttrain.safefile import open_append

    log_dir.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    with open_append(log_dir / f"rank{rank}.log") as f:
        os.dup2(f.fileno(), 2)


class _PrintsIntoLog(io.TextIOBase):
    """sys.stdout while a rank runs: each line user code prints (nanoGPT's `number of parameters`)
    becomes a record of the rank's log file only; stdout keeps the command's result alone."""

    def __init__(self) -> None:
        self._pending = ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        *lines, self._pending = (self._pending + text).split("\n")
        for line in lines:
            if line.strip():
                get_logger().info("stdout: %s", line, extra={FILE_ONLY: True})
        return len(text)

    def flush(self) -> None:
        if self._pending.strip():
            get_logger().info("stdout: %s", self._pending, extra={FILE_ONLY: True})
        self._pending = ""


@contextlib.contextmanager
def prints_into_log() -> Iterator[None]:
    """User code's `print` (model factories, data sets, tasks) goes to the rank's log, not stdout."""
    stream = _PrintsIntoLog()
    with contextlib.redirect_stdout(stream):
        try:
            yield
        finally:
            stream.flush()


@contextlib.contextmanager
def transformers_quiet() -> Iterator[None]:
    """The parent's dry build of a Hugging Face model: transformers' own warnings (`bos_token_id must
    be None or an integer within the vocabulary`, once per check) stay off the console; each rank
    logs them again into its log. `TRANSFORMERS_VERBOSITY` (read by transformers at its import)
    covers a first import inside the check, `set_verbosity` an earlier one; afterwards the level is
    what it was (or transformers' default, WARNING), so a one-rank run in this process logs them."""
    key = "TRANSFORMERS_VERBOSITY"
    saved = os.environ.get(key)
    before = sys.modules.get("transformers.utils.logging")
    level = before.get_verbosity() if before is not None else None
    if before is not None:
        before.set_verbosity(logging.ERROR)
    os.environ[key] = "error"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = saved
        after = sys.modules.get("transformers.utils.logging")
        if after is not None:
            named = logging.getLevelName(saved.upper()) if saved else logging.WARNING
            after.set_verbosity(
                level if level is not None else named if isinstance(named, int) else logging.WARNING
            )


def teardown_logging() -> None:
    log = get_logger()
    for h in list(log.handlers):
        h.flush()
        h.close()
        log.removeHandler(h)
