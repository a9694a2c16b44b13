"""Failures of launched ranks, reported as the first failing rank, its error and its log."""

from __future__ import annotations

import re
from pathlib import Path

from disttrain.rundir import RunDir


class LaunchError(RuntimeError):
    def __init__(self, rank: int | None, error: str, run_dir: Path, exit_code: int = 1) -> None:
        self.rank, self.error, self.run_dir, self.exit_code = rank, error, run_dir, exit_code
        where = f"rank {rank}" if rank is not None else "a rank"
        verb = "" if error.startswith(("was ", "exited", "stopped")) else "raised "
        log = RunDir(run_dir).rank_log(rank if rank is not None else 0)
        if "SIGABRT" in error and rank is not None:
            error += collective_mismatch(log)
        if exit_code > 128 and error.startswith("stopped by "):  # a user's Ctrl-C, a scheduler's stop
            head = f"interrupted by {error.removeprefix('stopped by ')}"
        else:
            head = f"training failed: {where} {verb}{error}"
        super().__init__(f"{head}\n  log: {log}\n  run dir: {run_dir}")


# What usually sends a rank a signal that names no cause of its own.
LIKELY = {
    7: (  # SIGBUS
        ": a memory-mapped file shrank under it, most often a token file (data=tokens' data.path) "
        "rewritten while the run reads it, or /dev/shm is full (DataLoader workers' shared memory)"
    ),
}


def exit_code_message(code: int | None) -> str:
    """'was killed by SIGKILL (signal 9)' for a signal death, 'exited with code N' otherwise."""
    import signal

    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name} (signal {-code}){LIKELY.get(-code, '')}"
        except ValueError:
            return f"was killed by signal {-code}"
    if code is not None and code > 128:
        try:
            name = signal.Signals(code - 128).name
            return f"stopped by {name} (exit code {code}; it saved a checkpoint if configured)"
        except ValueError:
            pass
    return f"exited with code {code} before Python could record an error"


# What gloo (and NCCL under TORCH_DISTRIBUTED_DEBUG=DETAIL) write before aborting a rank whose
# collective does not match its peers' (another kind, order or size).
MISMATCH = ("collective mismatch", "mismatch between collectives", "Received data size doesn't match")
_LOG_TAIL = 256 * 1024  # bytes of a rank log searched (its end: the abort is the last thing it wrote)


def collective_mismatch(log: Path) -> str:
    """For a rank killed by SIGABRT: when its log ends with the backend's words for a collective
    mismatch (no Python exception: the C++ side aborts), that line and its likely causes."""
    try:
        with log.open("rb") as f:
            f.seek(max(0, log.stat().st_size - _LOG_TAIL))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    line = next((ln.strip() for ln in reversed(text.splitlines()) if any(m in ln for m in MISMATCH)), "")
    if not line:
        return ""
    return (
        f" inside a collective; its log says: {line[:400]}. Likely a collective mismatch: the ranks "
        "did not call the same collectives with the same sizes, e.g. a task that gathers a batch "
        "assuming equal sizes (validation batches may be uneven: the last one is smaller on some "
        "ranks), or code that skips a collective on some ranks. HINT: gather uneven batches with "
        "disttrain.dist.gather_batch (docs/your-own-code.md)"
    )


# What a rank raises when it only saw a peer die (its own failure is not the cause).
SECONDARY = ("a peer rank died", "Connection closed by peer", "Connection reset by peer")


def is_secondary(message: str) -> bool:
    return any(m in message for m in SECONDARY)


_HEADER = "Traceback (most recent call last):"
_EXCEPTION_LINE = re.compile(
    r"[A-Za-z_][\w.]*(:|$)"
)  # `ValueError: ...`, `pkg.mod.MyError: ...`, `KeyboardInterrupt`
_MAX_SUMMARY = 900  # a hang's paragraph names every group of ranks and a file:line each


def error_summary(text: str) -> str:
    """The exception type and the first meaningful line of its message, from a formatted traceback
    (a spawned rank's) or an exception's `Type: message` text (torchelastic's error file).

    Not the last line: a message may span lines (`fully_shard` ends its with a module's repr), and
    its last line is then a lone `)`. In a traceback the exception starts at the first line after
    the last header's indented frames; in an error file at the first line shaped like `Type: ...`.
    """
    lines = [ln.rstrip() for ln in text.strip().splitlines()]
    if _HEADER in lines:
        after = lines[len(lines) - 1 - lines[::-1].index(_HEADER) + 1 :]
        start = next((i for i, ln in enumerate(after) if ln and not ln[0].isspace()), None)
        exception = after[start:] if start is not None else []
    else:
        start = next((i for i, ln in enumerate(lines) if _EXCEPTION_LINE.match(ln)), None)
        exception = lines[start:] if start is not None else lines
    meaningful = [ln.strip() for ln in exception if any(c.isalnum() for c in ln)]
    if not meaningful:
        return "an unknown error"
    first = meaningful[0]
    if first.endswith(":") and len(meaningful) > 1:  # `ValueError:` with the message on the next line
        first = f"{first} {meaningful[1]}"
    return first if len(first) <= _MAX_SUMMARY else first[: _MAX_SUMMARY - 3] + "..."


def stopped_message(signame: str, run_dir: Path, since: float) -> str:
    """What a stop on `signame` left behind: "saved" only for a signal checkpoint committed since then."""
    from disttrain import checkpoint

    ckpt_dir = RunDir(run_dir).checkpoints
    name = checkpoint.read_latest(ckpt_dir)
    meta: dict[str, object] = {}
    if name:
        try:
            meta = checkpoint.read_meta(ckpt_dir / name)
        except (OSError, ValueError):
            meta = {}
    fresh = float(meta.get("time", 0) or 0) >= since  # type: ignore[arg-type]
    if fresh and meta.get("reason") in ("signal", "final"):
        what = "signal" if meta["reason"] == "signal" else "final"
        return (
            f"stopped by {signame}: the ranks saved the {what} checkpoint {name} (step {meta.get('step')}); "
            f"continue with `disttrain resume {run_dir}`"
        )
    previous = f"the latest checkpoint is {name}" if name else "there is no checkpoint"
    if on_signal(run_dir):
        hint = (
            "a signal before the first step stops the ranks at once (nothing trained since the start or "
            "the resumed checkpoint); later, raise launcher.stop_grace_s if a step plus a save takes longer."
        )
    else:
        hint = "checkpoint.on_signal=true saves one."
    return f"stopped by {signame}: the ranks saved NO checkpoint on the signal ({previous}). HINT: {hint}"


def forced_message(signame: str, run_dir: Path) -> str:
    """A second signal while the ranks were stopping on the first (Ctrl-C twice): the launcher did
    not wait for their save; what is on disk is the latest committed checkpoint, untouched."""
    from disttrain import checkpoint

    name = checkpoint.read_latest(RunDir(run_dir).checkpoints)
    kept = f"the latest checkpoint {name} is intact" if name else "there is no checkpoint"
    return (
        f"stopped by {signame} twice: the second does not wait for the ranks' save, they exit without "
        f"a checkpoint ({kept}); continue with `disttrain resume {run_dir}`"
    )


def on_signal(run_dir: Path) -> bool:
    """The run's checkpoint.on_signal (True, the default, when config.yaml does not say)."""
    import yaml

    try:
        cfg = yaml.safe_load(RunDir(run_dir).config.read_text(encoding="utf-8"))
        value = cfg["checkpoint"]["on_signal"]
    except (OSError, ValueError, KeyError, TypeError, yaml.YAMLError):
        return True
    return value is not False
