"""Plain files of a checkpoint: written fsynced and atomically, read with weights_only=True,
and the digests the manifest records of each."""

from __future__ import annotations

import io
import logging
import os
from pathlib import Path
from typing import Any

import torch

from disttrain.checkpoint.reading import (
    XXH3,
    Checksum,
    file_digest,
    refuse_compressed,
)
from disttrain.storage import ObjectPath

log = logging.getLogger("disttrain")


def save_atomic(state: dict[str, Any], path: Path | ObjectPath) -> Path | ObjectPath:
    """torch.save to a fresh temporary file, fsync, rename: the file at `path` is always whole.
    An object in a store: one PUT of the bytes, whole or absent.

    The temp name is random and created exclusively (never a planted symlink followed)."""
    from disttrain.safefile import write_atomic

    if isinstance(path, ObjectPath):
        buf = io.BytesIO()
        torch.save(state, buf)
        path.write_bytes(buf.getvalue())
        return path

    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda f: torch.save(state, f), sync=True)
    fsync_dir(path.parent)
    return path


def load(path: Path | ObjectPath, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """A torch.save file, loaded with weights_only=True (an object in a store: read once, in memory)."""
    source: Path | io.BytesIO = io.BytesIO(path.read_bytes()) if isinstance(path, ObjectPath) else path
    refuse_compressed(source, str(path))  # a deflated record would inflate in full
    state: dict[str, Any] = torch.load(source, map_location=map_location, weights_only=True)
    return state


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path: Path, data: bytes) -> None:
    """Write and fsync; a symlink at `path` (planted in a shared run dir) fails, never followed."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _file_digest(path: Path, with_hash: bool) -> dict[str, Any]:
    """Size (and xxh3_64) of a file as it is on disk: a manifest entry."""
    return file_digest(path, XXH3 if with_hash else None)


def _bytes_digest(data: bytes, with_hash: bool) -> dict[str, Any]:
    """The manifest entry of a file whose bytes are `data` (summed in memory, never re-read)."""
    entry: dict[str, Any] = {"size": len(data)}
    if with_hash:
        c = Checksum(XXH3)
        c.update(data)
        entry[XXH3] = c.hexdigest()
    return entry


class _HashingFile:
    """A file DCP writes through, summing each buffer on its way to disk: the manifest's xxh3_64
    costs no second read of the checkpoint. Writes are strictly sequential (no seek: a writer that
    tried one would fail, never record a wrong hash); `commit_dir` checks each size on disk too."""

    def __init__(self, f: Any, with_hash: bool) -> None:
        self._f = f
        self._h = Checksum(XXH3) if with_hash else None
        self.size = 0

    def write(self, data: Any) -> int:
        n: int = self._f.write(data)
        view = memoryview(data)
        if self._h is not None:
            self._h.update(view)  # xxhash drops the GIL on big buffers: DCP's threads sum in parallel
        self.size += view.nbytes
        return n

    def tell(self) -> int:
        return int(self._f.tell())

    def flush(self) -> None:
        self._f.flush()

    def fileno(self) -> int:
        return int(self._f.fileno())

    def close(self) -> None:
        self._f.close()

    def digest(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"size": self.size}
        if self._h is not None:
            entry[XXH3] = self._h.hexdigest()
        return entry
