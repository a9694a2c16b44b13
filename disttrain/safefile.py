"""Files written into run dirs without following a symlink someone planted there.

A run dir may be shared (group-writable, a cluster scratch folder). A predictable temp name such as
`.latest.tmp`, or a log opened for append, would follow a symlink planted under that name and
overwrite the file it points to. Temp files here come from `tempfile.mkstemp` (O_EXCL, random
name) and appends open with O_NOFOLLOW; the final `os.replace` replaces a planted link, never
writes through it.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any


def write_atomic(path: Path, data: bytes | Callable[[IO[bytes]], Any], sync: bool = False) -> Path:
    """Write `data` (bytes, or a function writing to the open file) to a fresh temp file beside
    `path`, then rename it over `path`: readers see the old or the new file, whole."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)
    return path


def write_text_atomic(path: Path, text: str, mode: int | None = None) -> Path:
    """`write_atomic` of UTF-8 text; `mode` (e.g. 0o755) is set on the temp file before the rename."""

    def write(f: IO[bytes]) -> None:
        if mode is not None:
            os.fchmod(f.fileno(), mode)
        f.write(text.encode("utf-8"))

    return write_atomic(path, write)


def open_append(path: Path, encoding: str = "utf-8", newline: str | None = None) -> IO[str]:
    """Open a log for appending; a symlink at `path` raises OSError (ELOOP) instead of being followed."""
    flags = (
        os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    )
    fd = os.open(path, flags, 0o666)
    return os.fdopen(fd, "a", encoding=encoding, newline=newline)
