"""Failures of launched ranks, reported as the first failing rank, its error and its log."""

from __future__ import annotations

from pathlib import Path


class LaunchError(RuntimeError):
    def __init__(self, rank: int | None, error: str, run_dir: Path, exit_code: int = 1) -> None:
        self.rank, self.error, self.run_dir, self.exit_code = rank, error, run_dir, exit_code
        where = f"rank {rank}" if rank is not None else "a rank"
        verb = "" if error.startswith(("was ", "exited", "stopped")) else "raised "
        log = run_dir / "logs" / f"rank{rank if rank is not None else 0}.log"
        super().__init__(f"training failed: {where} {verb}{error}\n  log: {log}\n  run dir: {run_dir}")


def exit_code_message(code: int | None) -> str:
    """'was killed by SIGKILL (signal 9)' for a signal death, 'exited with code N' otherwise."""
    import signal

    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name} (signal {-code})"
        except ValueError:
            return f"was killed by signal {-code}"
    if code is not None and code > 128:
        try:
            name = signal.Signals(code - 128).name
            return f"stopped by {name} (exit code {code}; it saved a checkpoint if configured)"
        except ValueError:
            pass
    return f"exited with code {code} before Python could record an error"


def last_error_line(text: str) -> str:
    """The exception line of a formatted traceback (its last non-empty line)."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "an unknown error"
