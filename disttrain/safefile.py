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


def umask() -> int:
    """The process's umask, read without changing it (os.umask sets it: a race with any thread
    creating files meanwhile, such as DCP's writers). Linux >= 4.7 reports it in /proc."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def default_mode() -> int:
    """What `open(path, "w")` would give a new file: 0666 less the umask. mkstemp makes 0600 files,
    and an atomic rename keeps that mode: teammates on a shared cluster could not read the config,
    the status or final.pt of a run they can see."""
    return 0o666 & ~umask()


def write_atomic(path: Path, data: bytes | Callable[[IO[bytes]], Any], sync: bool = False) -> Path:
    """Write `data` (bytes, or a function writing to the open file) to a fresh temp file beside
    `path`, then rename it over `path`: readers see the old or the new file, whole, with the mode a
    plain write would give it (umask), unless the writer sets one itself."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.fchmod(fd, default_mode())
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


def remove_unfinished(directory: Path) -> list[str]:
    """Remove what `write_atomic`s that never finished left in `directory` (not below it): temp
    files of its `.NAME.RANDOM.tmp` form, never following a link. A process killed inside a write
    runs no cleanup: a rank that a Ctrl-C ends before its stop flag is up (SIGINT's default action,
    `launch.forkserver.rank_signals`) or a SIGKILL. The names removed."""
    removed: list[str] = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        if entry.name.startswith(".") and entry.name.endswith(".tmp") and entry.name.count(".") >= 3:
            try:
                if entry.is_symlink() or entry.is_file(follow_symlinks=False):
                    os.unlink(entry.path)
                    removed.append(entry.name)
            except OSError:
                continue
    return removed


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


def compressed_record(data: Any) -> str | None:
    """Why a torch.save file (`data`: a path or a seekable binary file, left at its start) is not
    one torch.save wrote, or None: torch.save stores its zip records uncompressed, and `torch.load`
    inflates a deflated one in full (a 2 MB file can ask for GBs). A record that is compressed, or
    larger than the whole file, is named. Not a zip archive (torch's legacy format): None."""
    import io
    import zipfile

    try:
        if isinstance(data, Path | str):
            size = os.path.getsize(data)
        else:
            size = data.seek(0, io.SEEK_END)
            data.seek(0)
        with zipfile.ZipFile(data) as z:
            infos = z.infolist()
    except zipfile.BadZipFile:
        return None
    finally:
        if not isinstance(data, Path | str):
            data.seek(0)
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED or info.file_size > size:
            return (
                f"its record {info.filename[:80]!r} is compressed ({info.file_size} bytes from "
                f"{info.compress_size}); torch.save never compresses, so the file was not written by it"
            )
    return None
