"""Failures of launched ranks, reported as the first failing rank, its error and its log."""

from __future__ import annotations

from pathlib import Path


class LaunchError(RuntimeError):
    def __init__(self, rank: int | None, error: str, run_dir: Path) -> None:
        self.rank, self.error, self.run_dir = rank, error, run_dir
        where = f"rank {rank}" if rank is not None else "a rank"
        log = run_dir / "logs" / f"rank{rank if rank is not None else 0}.log"
        super().__init__(f"training failed: {where} raised {error}\n  log: {log}\n  run dir: {run_dir}")


def last_error_line(text: str) -> str:
    """The exception line of a formatted traceback (its last non-empty line)."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "an unknown error"
