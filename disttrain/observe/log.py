"""One rank-aware logger: rank 0 to the console (stderr), every rank to its own file in the run dir.

stdout carries only a command's result (the `done:` line, `--json`), so `disttrain train ... | tee`
and scripts that parse stdout see no log lines.
"""

from __future__ import annotations

import logging
import sys
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
            ch: logging.Handler = RichHandler(console=console, show_path=False, markup=False)
        else:
            ch = logging.StreamHandler(sys.stderr)
            ch.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
        ch.addFilter(lambda record: not getattr(record, FILE_ONLY, False))
        log.addHandler(ch)
    return log


def teardown_logging() -> None:
    log = get_logger()
    for h in list(log.handlers):
        h.flush()
        h.close()
        log.removeHandler(h)
