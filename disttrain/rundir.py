"""The run directory: the frozen config and everything needed to reproduce the run from it."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

CONFIG = "config.yaml"


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)


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
    write_json(run_dir / "git.json", git_state(Path.cwd()))


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
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


def command_line() -> list[str]:
    return [Path(sys.argv[0]).name, *sys.argv[1:]]
