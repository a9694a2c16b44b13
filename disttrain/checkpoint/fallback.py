"""Which checkpoint to load: each candidate verified against its manifest (sizes, then checksums
as it is read), falling back to the previous good one and naming the bad file; then its shards."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from disttrain.checkpoint.dcp_read import _planner, _reader
from disttrain.checkpoint.files import load
from disttrain.checkpoint.layout import MANIFEST, META, read_latest
from disttrain.checkpoint.reading import (
    CorruptCheckpoint,
    algo_of,
    entries_problem,
    file_digest,
    meta_problem,
    mismatch,
)
from disttrain.checkpoint.retention import committed
from disttrain.rundir import RunDir
from disttrain.storage import ObjectPath

log = logging.getLogger("disttrain")


def problem(path: Path | ObjectPath, verify: str = "hash") -> str | None:
    """Why the checkpoint at `path` is not loadable (naming the file), or None when it is whole."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
    except FileNotFoundError:
        return f"{path / MANIFEST} is missing (the save never committed)"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{path / MANIFEST} is unreadable ({exc})"
    if why := entries_problem(path / MANIFEST, files):
        return why
    for fname in (".metadata", META):
        if fname not in files:
            return f"{path / MANIFEST} lists no {fname}"
    sizes = path.files() if isinstance(path, ObjectPath) else None  # one listing, not a request a file
    for fname, want in files.items():
        f = path / fname
        if sizes is not None:
            if fname not in sizes:
                return f"{f} is missing"
            if why := mismatch(f, want, sizes[fname], None):
                return why
            continue
        if f.is_symlink() or not f.is_file():  # a link or FIFO planted there is never read
            return f"{f} is missing" if not os.path.lexists(f) else f"{f} is not a regular file"
        if why := mismatch(f, want, f.stat().st_size, None):
            return why
    hashed = [fname for fname, want in files.items() if verify == "hash" and algo_of(want)]
    # One thread per file (xxhash, zlib, hashlib and reads release the GIL): the shards sum in parallel.
    with ThreadPoolExecutor(max_workers=max(1, min(len(hashed), os.cpu_count() or 1, 8))) as pool:
        got = pool.map(lambda n: file_digest(path / n, algo_of(files[n])), hashed)
        for fname, entry in zip(hashed, got, strict=True):
            algo = algo_of(files[fname])
            if why := mismatch(path / fname, files[fname], entry["size"], entry[algo] if algo else None):
                return why
    return None


def candidates(location: Path | ObjectPath) -> list[Any]:
    """Checkpoints to try, best first: `location` itself, or a run/checkpoints dir's latest, then older."""
    if named(location):
        return [location, *reversed([p for p in committed(location.parent) if p.name < location.name])]
    ckpt_dir: Path | ObjectPath = location
    if isinstance(location, Path) and (own := RunDir(location).checkpoints).is_dir():
        ckpt_dir = own
    found = list(reversed(committed(ckpt_dir)))
    latest = read_latest(ckpt_dir)
    if latest and (ckpt_dir / latest).is_dir():
        found.sort(key=lambda p: p.name != latest)  # `latest` first; it may be older after a manual resume
    return found


def choose(
    location: Path | ObjectPath, verify: str = "hash", skip: Collection[Any] = (), fallback: bool = True
) -> Path | ObjectPath | None:
    """The newest whole checkpoint at `location` not in `skip` (those failed to load); warns
    naming each bad file it passes over. A checkpoint that vanished meanwhile (its run is training
    and pruned it) is passed over with one quiet line. `fallback=False`: `location` itself only
    (a checkpoint the user named), None when it is not whole."""
    for path in candidates(location) if fallback else [location]:
        if path in skip:
            continue
        why = problem(path, verify)
        if why is None:
            return path
        if pruned(path):
            log.info(
                "checkpoint %s was pruned meanwhile (its run is training); taking the next newest", path.name
            )
        else:
            log.warning("checkpoint %s is not loadable: %s; falling back to the previous one", path.name, why)
    return None


def pruned(path: Path | ObjectPath) -> bool:
    """Whether the checkpoint folder at `path` is gone (a training run's keep-N removed it)."""
    if isinstance(path, ObjectPath):
        return not (path / MANIFEST).exists()
    return not os.path.lexists(path)


def named(location: Path | ObjectPath) -> bool:
    """Whether `location` is one checkpoint folder (step_N/), not a run or checkpoints/ dir."""
    return (location / MANIFEST).exists() or (location / ".metadata").exists()


def load_errors() -> tuple[type[BaseException], ...]:
    """What a failed load raises: DCP's CheckpointException derives from BaseException, not Exception."""
    from torch.distributed.checkpoint import CheckpointException

    return (Exception, CheckpointException)


def why_not(exc: BaseException) -> str:
    """One line for a load that failed. DCP wraps the cause's traceback: its last line names it."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    if len(lines) > 1:
        return lines[-1][:300]
    return f"{type(exc).__name__}: {lines[0][:300]}" if lines else type(exc).__name__


def read_meta(path: Path | ObjectPath) -> dict[str, Any]:
    """meta.json, checked (`meta_problem`): CorruptCheckpoint (a ValueError) names a bad field."""
    meta = json.loads((path / META).read_text())
    if why := meta_problem(meta):
        raise CorruptCheckpoint(f"{path / META} {why}")
    return dict(meta)


def dcp_metadata(path: Path | ObjectPath) -> Any:
    """The DCP `.metadata` of the checkpoint at `path` (names, shapes, dtypes of every entry),
    through the allow-list: what a checkpoint holds, without reading a shard."""
    return _reader(path).read_metadata()


def load_sharded(
    path: Path | ObjectPath, app_state: dict[str, Any], rank: int, no_dist: bool = False, verify: str = "size"
) -> dict[str, Any] | None:
    """Fill `app_state` in place from the DCP checkpoint at `path` (resharding as needed).

    verify="hash": every rank checks the checksum (xxh3_64; crc32 or sha256 in older manifests) of each file
    it reads, in the same pass that reads it, and rank 0 checks the files it does not read
    (.metadata, meta.json, rng files, other ranks' shards) beside; a mismatch raises
    CorruptCheckpoint (a load error: the caller falls back). A caller that chose `path` with
    `choose(..., "hash")` has checked it already and passes "size".

    Returns this rank's saved RNG states, or None when the checkpoint had no rank of this number.
    """
    import torch.distributed.checkpoint as dcp

    expected = None
    if verify == "hash" and (path / MANIFEST).is_file():
        try:
            expected = json.loads((path / MANIFEST).read_text())["files"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CorruptCheckpoint(f"{path / MANIFEST} is unreadable ({exc})") from exc
        if why := entries_problem(path / MANIFEST, expected):
            raise CorruptCheckpoint(why)
    reader = _reader(path, expected, check_unread=rank == 0)
    # Read here, not first inside dcp.load: DCP logs a failed read with its traceback ("Global
    # metadata is not found") before it gives up; a checkpoint pruned meanwhile raises quietly here.
    reader.metadata = reader.read_metadata()
    try:
        dcp.load(app_state, storage_reader=reader, planner=_planner(), no_dist=no_dist)
    except dcp.CheckpointException as exc:  # DCP wraps each rank's error: name the corrupt file
        for failure in exc.failures.values():
            if isinstance(cause := failure[0] if isinstance(failure, tuple) else failure, CorruptCheckpoint):
                raise CorruptCheckpoint(str(cause)) from exc
        raise
    rng_file = path / f"rng_rank{rank}.pt"
    return load(rng_file) if rng_file.is_file() else None
