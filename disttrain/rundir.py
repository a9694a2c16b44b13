"""The run directory: the frozen config and everything needed to reproduce the run from it."""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

CONFIG = "config.yaml"


def write_json(path: Path, data: Any) -> None:
    _write_text(path, json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def read_config(run_dir: Path) -> dict[str, Any]:
    """The frozen, fully resolved config: plain YAML, no interpolation left to re-resolve."""
    with (run_dir / CONFIG).open(encoding="utf-8") as f:
        cfg: dict[str, Any] = yaml.safe_load(f)
    return cfg


def freeze(run_dir: Path, cfg: dict[str, Any], overrides: list[str], argv: list[str]) -> None:
    """Write config.yaml (resolved once), overrides.yaml, the command line and the git state."""
    run_dir.mkdir(parents=True, exist_ok=True)
    _write_text(run_dir / CONFIG, yaml.safe_dump(cfg, sort_keys=False))
    _write_text(run_dir / "overrides.yaml", yaml.safe_dump(list(overrides)))
    _write_text(run_dir / "command.txt", shlex.join(argv) + "\n")
    git = git_state(Path.cwd())
    write_json(run_dir / "git.json", git)
    if git.get("dirty"):  # the uncommitted changes the run used, for `git apply` after a checkout
        _write_text(run_dir / "git.diff", git_diff(Path.cwd()))


def _write_text(path: Path, text: str) -> None:
    """Atomic replace. The temp name is per host and process: the nodes of a multi-node run write
    the same files into one run dir on a shared file system, and must not rename each other's."""
    tmp = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def git_state(directory: Path) -> dict[str, Any]:
    """SHA and dirty flag of the repo containing `directory`, if any."""

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(
                ["git", *args], cwd=directory, capture_output=True, text=True, timeout=10, check=True
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip()

    sha = git("rev-parse", "HEAD")
    if sha is None:
        return {"repo": None, "sha": None, "dirty": None}
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"repo": git("rev-parse", "--show-toplevel"), "sha": sha, "dirty": bool(status)}


def git_diff(directory: Path) -> str:
    """`git diff HEAD` (tracked files, staged or not) of the repo containing `directory`."""
    try:
        out = subprocess.run(
            ["git", "diff", "HEAD"], cwd=directory, capture_output=True, text=True, timeout=30, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout


def command_line() -> list[str]:
    return [Path(sys.argv[0]).name, *sys.argv[1:]]


STATUS = "status.json"


@contextmanager
def run_status(run_dir: Path) -> Iterator[None]:
    """status.json: `running` while the ranks run, then finished, failed (with the error) or interrupted.

    Written by the parent that launches the ranks, so a crash of any rank is still recorded.
    """
    import time

    base = {"started": time.time(), "host": socket.gethostname(), "pid": os.getpid()}
    write_json(run_dir / STATUS, {"status": "running", **base})
    end: dict[str, Any] = {"status": "finished"}
    try:
        yield
    except BaseException as exc:
        # Ctrl-C, torchrun's agent turning SIGINT/SIGTERM into SignalException, or a LaunchError
        # whose ranks stopped on a signal (exit code 128 + signal number)
        signalled = (
            isinstance(exc, KeyboardInterrupt)
            or type(exc).__name__ == "SignalException"
            or getattr(exc, "exit_code", 0) > 128
        )
        error = getattr(exc, "error", None) or (str(exc).splitlines() or [type(exc).__name__])[0]
        end = {"status": "interrupted" if signalled else "failed", "error": error or type(exc).__name__}
        if getattr(exc, "rank", None) is not None:
            end["rank"] = exc.rank  # type: ignore[attr-defined]
        if signalled and not isinstance(exc, KeyboardInterrupt) and getattr(exc, "sigval", None) == 2:
            raise KeyboardInterrupt from None  # Ctrl-C reaches the CLI as Ctrl-C: "interrupted", exit 130
        raise
    finally:
        write_json(run_dir / STATUS, {**base, **end, "ended": time.time()})
