"""The atomic commit: a finished `.tmp-<name>/` renamed into place, its manifest written last,
`latest` (and `best`) replaced with os.replace."""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from disttrain.checkpoint.files import _bytes_digest, _file_digest, _write_synced, fsync_dir
from disttrain.checkpoint.layout import MANIFEST, META, TMP, point_best, point_latest
from disttrain.checkpoint.reading import (
    XXH3,
    algo_of,
)
from disttrain.checkpoint.retention import prune

log = logging.getLogger("disttrain")


def commit_dir(
    ckpt_dir: Path,
    tmp: Path,
    name: str,
    meta: dict[str, Any],
    verify: str,
    keep: int,
    digests: dict[str, dict[str, Any]] | None = None,
    protect: Sequence[str] = (),
) -> Path:
    """meta.json, manifest.json (last), fsync, rename into place, replace `latest`, prune old ones.

    `digests` holds the entries hashed while each file was written (every writer fsynced its own
    file); a file without one, or whose size on disk differs, is fsynced and hashed from disk."""
    with_hash = verify == "hash"
    meta_bytes = json.dumps(meta, indent=1, sort_keys=True, default=str).encode()
    _write_synced(tmp / META, meta_bytes)
    known = {**(digests or {}), META: _bytes_digest(meta_bytes, with_hash)}
    entries = {}
    for p in sorted(p for p in tmp.iterdir() if p.is_file() and p.name != MANIFEST):
        entry = known.get(p.name)
        # a digest is trusted only when it is this version's (xxh3_64) and of the size on disk
        if (
            entry is None
            or entry["size"] != p.stat().st_size
            or algo_of(entry) != (XXH3 if with_hash else None)
        ):
            with p.open("rb") as f:
                os.fsync(f.fileno())
            entry = _file_digest(p, with_hash)
        entries[p.name] = entry
    manifest = {"files": entries, "name": name}
    _write_synced(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
    fsync_dir(tmp)
    final = ckpt_dir / name
    if final.exists():  # the same step saved again (e.g. an emergency save after a periodic one)
        old = ckpt_dir / f"{TMP}old-{name}"
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    # One directory fsync (in point_latest) makes both renames durable before prune deletes
    # anything; a crash before it leaves `latest` naming a folder that may not exist, and
    # `candidates` then falls back to the newest committed folder.
    point_latest(ckpt_dir, name)
    if protect and (ckpt_dir / protect[0]).is_dir():
        point_best(ckpt_dir, protect[0])
    prune(ckpt_dir, keep, protect)
    return final
