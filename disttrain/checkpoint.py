"""Checkpoint files: written to a temporary name, flushed, then renamed, so a crash at any moment
leaves the previous file whole. Loading is always `weights_only=True`: a checkpoint never runs code.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch


def save_atomic(state: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def load(path: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    state: dict[str, Any] = torch.load(path, map_location=map_location, weights_only=True)
    return state


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
