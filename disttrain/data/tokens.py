"""Memory-mapped token files (nanoGPT's `.bin`: raw little-endian uint16 or uint32 token ids).

Nothing is read into RAM: each process (a rank, a DataLoader worker) opens its own `np.memmap` on
first use, and pickling the data set (to a worker) carries the paths, never the tokens. It is
map-style over a deterministic index, so the sampler's position resumes it exactly:

- `sequential`: sample i is the i-th non-overlapping window of `block_size + 1` tokens;
- `random`: sample i starts at a pseudo-random offset drawn from (seed, i) (splitmix64), uniform
  over every start in the files: nanoGPT's `get_batch` windows, the same for any world size.

Token files in an object store (`data.path=s3://bucket/tokens/*.bin`) are read the same way through
fsspec: each process opens each object once and reads the windows it needs with ranged reads of
at most RANGE bytes (a read-ahead buffer), never the whole object.

Several files (a glob) are one token sequence for the tail split and are windowed each on its own
(no window spans two files). x = window[:-1], y = window[1:] (targets shifted by one).

`packing=True` (`data.packing=true data.eos_id=ID`): a sample is a packed row instead
(disttrain.data.packing): window[:-1] cut into documents after each `eos_id`, positions restarting
per document, labels unshifted with the first token of each document not trained.
"""

from __future__ import annotations

import bisect
import glob
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from disttrain.data.packing import window_row
from disttrain.storage import ObjectPath, filesystem, is_url

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
RANGE = 1 << 16  # bytes one ranged read of a token object fetches at most (its read-ahead)
MASK = (1 << 64) - 1


@dataclass(frozen=True)
class Segment:
    """Tokens [start, end) of one file."""

    path: str
    start: int
    end: int


def splitmix64(x: int) -> int:
    """A 64-bit mix (Steele et al., SplittableRandom): seed and index -> a uniform 64-bit value."""
    x = (x + 0x9E3779B97F4A7C15) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def token_files(pattern: str) -> list[str]:
    """One file, or the sorted files of a glob (shards in name order)."""
    if is_url(pattern):
        scheme, _, key = pattern.partition("://")
        fs = filesystem(pattern)
        names = fs.glob(key) if glob.has_magic(key) else [key]
        files = sorted(f"{scheme}://{n}" for n in names if fs.isfile(n))
        if not files:
            raise FileNotFoundError(f"no token object matches {pattern}")
        return files
    files = sorted(glob.glob(os.path.expanduser(pattern)))
    if not files:
        raise FileNotFoundError(f"no token file matches {pattern}")
    return files


def segments(files: list[str], itemsize: int, part: str, val_fraction: float) -> list[Segment]:
    """The files as one token sequence cut at 1 - val_fraction: the head trains, the tail validates."""
    sizes = [file_size(f) // itemsize for f in files]
    total = sum(sizes)
    cut = total if part == "all" else int(total * (1.0 - val_fraction))
    lo, hi = (0, cut) if part in ("train", "all") else (cut, total)
    out, at = [], 0
    for f, n in zip(files, sizes, strict=True):
        start, end = max(lo, at) - at, min(hi, at + n) - at
        if end > start:
            out.append(Segment(f, start, end))
        at += n
    return out


def file_size(path: str) -> int:
    return ObjectPath(path).stat().st_size if is_url(path) else os.path.getsize(path)


class TokenWindows(Dataset):
    """Windows of `block_size + 1` tokens over memory-mapped segments (see the module docstring)."""

    def __init__(
        self,
        parts: list[Segment],
        dtype: str,
        block_size: int,
        sampling: str = "sequential",
        seed: int = 0,
        eos_id: int | None = None,
    ) -> None:
        self.parts, self.dtype, self.block_size = parts, dtype, block_size
        self.sampling, self.seed = sampling, seed
        self.eos_id = eos_id  # packed rows, documents ending at this id (None: x, y windows)
        span = block_size + 1
        lengths = [p.end - p.start for p in parts]
        # sequential: non-overlapping windows per segment; random: every start per segment
        self.windows = np.cumsum([max(0, (n - 1) // block_size) for n in lengths]).tolist()
        self.starts = np.cumsum([max(0, n - span + 1) for n in lengths]).tolist()
        self._maps: dict[str, Any] | None = None  # opened lazily in each process: maps, store files

    def __len__(self) -> int:
        return int(self.windows[-1]) if self.windows else 0

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_maps"] = None  # a worker opens its own maps: never pickle the mapping
        return state

    def _map(self, path: str) -> Any:
        """The file's memory map, or (an object in a store) the file opened for ranged reads."""
        if self._maps is None:
            self._maps = {}
        if path not in self._maps:
            if is_url(path):
                self._maps[path] = ObjectPath(path).open("rb", block_size=RANGE, cache_type="readahead")
            else:
                self._maps[path] = np.memmap(path, dtype=DTYPES[self.dtype], mode="r")
        return self._maps[path]

    def _tokens(self, path: str, at: int, n: int) -> np.ndarray:
        """Tokens [at, at + n) of one file: a view of its map, or one ranged read of the object."""
        opened = self._map(path)
        if isinstance(opened, np.memmap):
            return opened[at : at + n]
        dtype = np.dtype(DTYPES[self.dtype])
        opened.seek(at * dtype.itemsize)
        return np.frombuffer(opened.read(n * dtype.itemsize), dtype=dtype)

    def offset(self, i: int) -> tuple[Segment, int]:
        """(segment, start within its file) of sample i."""
        if self.sampling == "random":
            u = splitmix64((self.seed * 0x9E3779B97F4A7C15 + i) & MASK) % int(self.starts[-1])
            k = bisect.bisect_right(self.starts, u)
            local = u - (self.starts[k - 1] if k else 0)
        else:
            k = bisect.bisect_right(self.windows, i)
            local = (i - (self.windows[k - 1] if k else 0)) * self.block_size
        part = self.parts[k]
        return part, part.start + int(local)

    def files(self) -> dict[str, int]:
        """{path: size in bytes} of the files the windows read (what a resume compares)."""
        return {p.path: file_size(p.path) for p in self.parts}

    def first_id_at_least(self, limit: int, chunk: int = 1 << 24) -> tuple[str, int, int] | None:
        """(path, token position, id) of the first id >= `limit` in the files the windows read
        (whole files: their validation tail too), or None. Reads each file once, `chunk` tokens at a
        time, with plain reads (no mapping left in this process's memory): the pre-launch check's
        sampled windows miss an id past them, which then fails a step later as a bare IndexError
        (or a CUDA device-side assert). Objects in a store are not scanned (that would download
        them whole before launch)."""
        dtype = np.dtype(DTYPES[self.dtype])
        for path in dict.fromkeys(p.path for p in self.parts):
            if is_url(path):  # scanning it here would download the whole object before launch
                continue
            with open(path, "rb") as f:
                at = 0
                while len(part := np.frombuffer(f.read(chunk * dtype.itemsize), dtype=dtype)):
                    if int(part.max()) >= limit:
                        where = int(np.argmax(part >= limit))
                        return path, at + where, int(part[where])
                    at += len(part)
        return None

    def __getitem__(self, i: int) -> Any:
        if not 0 <= i < len(self):
            raise IndexError(f"window {i} of {len(self)}")
        part, at = self.offset(i)
        chunk = torch.from_numpy(self._tokens(part.path, at, self.block_size + 1).astype(np.int64))
        if self.eos_id is not None:
            return window_row(chunk[:-1], self.eos_id)
        return chunk[:-1], chunk[1:]


def load_tokens(
    path: str,
    block_size: int = 64,
    dtype: str = "uint16",
    split: str = "train",
    sampling: str = "random",
    val_path: str | None = None,
    val_fraction: float = 0.0,
    seed: int = 0,
    packing: bool = False,
    eos_id: int | None = None,
) -> TokenWindows:
    """data=tokens: the training windows of `path` (a file or glob), or the validation ones: of
    `val_path` when given (sequential), else the held-out tail `val_fraction` of `path`. `packing`:
    packed rows of the documents `eos_id` ends (checked before launch: eos_id is set)."""
    if split not in ("train", "val"):
        raise ValueError(f"data split={split!r}: choose train or val")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: choose uint16 or uint32")
    itemsize = np.dtype(DTYPES[dtype]).itemsize
    eos = eos_id if packing else None
    if split == "val" and val_path:
        return TokenWindows(
            segments(token_files(val_path), itemsize, "all", 0.0), dtype, block_size, eos_id=eos
        )
    fraction = 0.0 if val_path else val_fraction
    parts = segments(token_files(path), itemsize, split, fraction)
    if split == "val":
        return TokenWindows(parts, dtype, block_size, eos_id=eos)  # validation reads the tail in order
    return TokenWindows(parts, dtype, block_size, sampling, seed, eos_id=eos)
