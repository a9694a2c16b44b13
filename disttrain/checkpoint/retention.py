"""Which committed checkpoints stay: `keep` newest (and the protected ones), and a resumed run's
abandoned timeline moved aside under `superseded/`."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Collection
from pathlib import Path
from typing import Any

from disttrain.checkpoint import remote
from disttrain.checkpoint.files import fsync_dir
from disttrain.checkpoint.layout import (
    BEST,
    LATEST,
    PREFIX,
    SUPERSEDED,
    TMP,
    read_best,
    read_latest,
    step_name,
)
from disttrain.storage import ObjectPath

log = logging.getLogger("disttrain")


def committed(ckpt_dir: Path | ObjectPath) -> list[Any]:
    """Committed checkpoint folders, oldest first (by step number in the name)."""
    if isinstance(ckpt_dir, ObjectPath):
        return remote.committed(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    dirs = [p for p in ckpt_dir.iterdir() if p.is_dir() and p.name.startswith(PREFIX)]
    return sorted(dirs, key=lambda p: p.name)


def prune(ckpt_dir: Path | ObjectPath, keep: int, protect: Collection[str] = ()) -> list[Any]:
    """Delete all but the newest `keep` committed checkpoints (never the one `latest` or `best`
    names, nor those in `protect`: checkpoint.keep_best's)."""
    if isinstance(ckpt_dir, ObjectPath):
        return remote.prune(ckpt_dir, keep, protect)
    spared = {read_latest(ckpt_dir), read_best(ckpt_dir), *protect}
    doomed = [p for p in committed(ckpt_dir)[:-keep] if p.name not in spared]
    for p in doomed:
        # rename first: a kill mid-delete leaves a .tmp- folder (ignored), never a half checkpoint
        trash = ckpt_dir / f"{TMP}del-{p.name}"
        os.rename(p, trash)
        shutil.rmtree(trash, ignore_errors=True)
    return doomed


def supersede(ckpt_dir: Path | ObjectPath, step: int) -> list[Any]:
    """Move committed checkpoints past `step` into `superseded/` (a resume from `step` abandoned
    them); they stay on disk for the user but leave keep-N, `latest` and the fallback."""
    if isinstance(ckpt_dir, ObjectPath):
        return remote.supersede(ckpt_dir, step)
    moved = []
    for p in committed(ckpt_dir):
        if p.name > step_name(step):
            target = ckpt_dir / SUPERSEDED / p.name
            target.parent.mkdir(exist_ok=True)
            if target.exists():  # superseded twice at the same step: keep the newer copy
                shutil.rmtree(target)
            os.rename(p, target)
            moved.append(target)
    if moved:
        fsync_dir(ckpt_dir)
        if read_latest(ckpt_dir) in {p.name for p in moved}:
            (ckpt_dir / LATEST).unlink(missing_ok=True)
        if read_best(ckpt_dir) in {p.name for p in moved}:
            (ckpt_dir / BEST).unlink(missing_ok=True)
    return moved
