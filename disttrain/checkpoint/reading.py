"""Reading a DCP checkpoint at disk speed, checking every byte against the manifest on the way.

DCP 2.13's FileSystemReader has no knobs: one thread, and each tensor goes through a full
`torch.load` into a fresh tensor and then a `copy_` into the live one (two passes over memory).
`read_data` (store's SafeReader.read_data) reads the same files, the same format, through the same planner, but:
- one thread per file (reads, `copy_` and the checksums release the GIL on big buffers);
- a whole, contiguous CPU tensor is read straight into the live tensor (`readinto`): its item's
  small zip records (located by a `torch.load` onto the meta device) are read around it, and
  anything else (a resharded slice, a GPU tensor, a non-tensor) takes DCP's own path;
- with the manifest's entries (`expected`), each file is checksummed in the same pass, in file
  order (the gaps between the items this rank reads are read too), so a load verifies every byte
  it reads for the price of the checksum on memory that is already in cache. A mismatch raises
  CorruptCheckpoint (a load error: every rank falls back to an older checkpoint).

The checksum is xxh3_64 (~24 GB/s on one core here: a few percent of the read; zlib.crc32, which
manifests carried before, ran at ~2.5 GB/s and cost as much CPU as torch.load's whole read).
Manifests of older versions carry crc32 or sha256: each entry names its algorithm, and those are
still checked. Any other name is refused (CorruptCheckpoint), never looked up or imported.
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import sys
import threading
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import xxhash

# Manifest digests: xxh3_64 from now on; crc32 and sha256 in manifests of older versions, still checked.
XXH3, CRC32, SHA256 = "xxh3_64", "crc32", "sha256"
ALGOS = (XXH3, CRC32, SHA256)
_CHUNK = 1 << 22


class CorruptCheckpoint(ValueError):
    """A checkpoint's file does not match its manifest (found while loading it)."""


class _Crc32:
    """zlib.crc32 with hashlib's interface (the digest of manifests before xxh3_64)."""

    def __init__(self) -> None:
        self._crc = 0

    def update(self, data: Any) -> None:
        self._crc = zlib.crc32(data, self._crc)

    def hexdigest(self) -> str:
        return f"{self._crc:08x}"


# A fixed table: the name in a manifest only selects one of these, never imports anything.
_NEW: dict[str, Callable[[], Any]] = {XXH3: xxhash.xxh3_64, CRC32: _Crc32, SHA256: hashlib.sha256}


class Checksum:
    """The running digest of one file: xxh3_64 (new manifests), crc32 or sha256 (older ones).

    All three drop the GIL on big buffers (xxhash above 64 KiB), so the threads of a save or a
    load checksum in parallel."""

    def __init__(self, algo: str = XXH3) -> None:
        if algo not in _NEW:
            raise CorruptCheckpoint(f"unknown checkpoint checksum {algo[:40]!r} (known: {', '.join(ALGOS)})")
        self.algo = algo
        self._h = _NEW[algo]()

    def update(self, data: Any) -> None:
        self._h.update(data)

    def hexdigest(self) -> str:
        digest: str = self._h.hexdigest()
        return digest


def entry_problem(entry: Any) -> str | None:
    """Why a manifest entry is not one this version can check, or None. An entry is
    {"size": bytes} plus at most one digest, named by its algorithm (one of ALGOS)."""
    if not isinstance(entry, dict):
        return f"is {type(entry).__name__}, not an object"
    size = entry.get("size")
    if type(size) is not int or size < 0:
        return f"has size {str(size)[:40]!r}, not a byte count"
    digests = [k for k in entry if k != "size"]
    if len(digests) > 1:
        return f"carries {len(digests)} checksums ({', '.join(repr(str(k)[:40]) for k in digests[:4])}); one is allowed"
    if digests and digests[0] not in ALGOS:
        return (
            f"carries checksum {str(digests[0])[:40]!r}, which this version cannot check (known: "
            f"{', '.join(ALGOS)}): a manifest from a newer disttrain, or a corrupted one"
        )
    if digests and not isinstance(entry[digests[0]], str):
        return f"has {digests[0]} {str(entry[digests[0]])[:40]!r}, not a hex string"
    return None


# meta.json's counters: whole numbers a run can reach. A float step broke step_name's {:08d} after
# the load; 10**30 overflowed later (reliability D19): either is refused here, so the load falls back.
META_COUNTERS = ("step", "epoch", "samples", "epoch_samples")
META_MAX = 2**53


def meta_problem(meta: Any) -> str | None:
    """Why a checkpoint's meta.json cannot be resumed from (the field and its value), or None."""
    if not isinstance(meta, dict):
        return f"is {type(meta).__name__}, not an object"
    for key in META_COUNTERS:
        if key not in meta and key != "step":
            continue  # TrainState names a missing one when it loads
        value = meta.get(key)
        if type(value) is not int or not 0 <= value < META_MAX:
            return f"has {key} {str(value)[:40]!r}, not a count from 0 to 2**53"
    for key, kind in (
        ("trackers", dict),
        ("last_val", dict),
        ("states", list),
        ("watch", dict),
        ("best", list),
    ):
        if meta.get(key) is not None and not isinstance(meta[key], kind):
            return f"has {key} of type {type(meta[key]).__name__}, not {kind.__name__}"
    return None


def entries_problem(manifest: Any, files: Any) -> str | None:
    """Why a manifest's "files" cannot be checked (naming the manifest and the entry), or None."""
    if not isinstance(files, dict):
        return f'{manifest} is unreadable ("files" is {type(files).__name__}, not an object)'
    for fname, entry in files.items():
        if why := name_problem(fname) or entry_problem(entry):
            return f"{manifest}: the entry for {str(fname)[:100]!r} {why}"
    return None


def name_problem(fname: Any) -> str | None:
    """A manifest names files of its own folder only: `../x`, `/proc/kmsg` or `a/b` would make the
    loader stat, hash or read (and block on) a file anywhere."""
    if not isinstance(fname, str) or not fname or fname in (".", ".."):
        return "is not a file name"
    if "/" in fname or "\\" in fname or "\0" in fname:
        return "names a file outside the checkpoint folder"
    return None


def open_regular(path: Any) -> Any:
    """`path` opened for reading if it is a regular file; CorruptCheckpoint for a FIFO, a device or
    a link (opening a FIFO blocks, /dev/zero never ends: a checkpoint is data and names neither).
    O_NONBLOCK makes the open itself return at once; it changes nothing for a regular file."""
    import stat

    from disttrain.storage import ObjectPath

    if isinstance(path, ObjectPath):  # an object: no links, FIFOs or devices in a store
        f = path.open("rb")
        f.name = str(path)  # what _File's messages name
        return f
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        f = open(path, "rb", buffering=0, opener=lambda p, _: os.open(p, flags))  # noqa: SIM115
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CorruptCheckpoint(
                f"{path} is a symbolic link; a checkpoint's files are never read through one"
            ) from None
        raise
    if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
        f.close()
        raise CorruptCheckpoint(f"{path} is not a regular file; it is never read")
    return f


def storage_problem(metadata: Any, listed: Any) -> str | None:
    """Why DCP metadata's storage paths are not the checkpoint's own files, or None: each must be
    a file name of the folder (`name_problem`) and, when the manifest lists the folder's files
    (`listed`), one of them (a name it does not list would be read unchecked)."""
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        rel = getattr(info, "relative_path", None)
        if why := name_problem(rel):
            return f"its .metadata stores an item in {str(rel)[:200]!r}, which {why}"
        if listed is not None and rel not in listed:
            return f"its .metadata stores an item in {str(rel)[:200]!r}, which its manifest does not list"
    return None


def refuse_compressed(data: Any, what: str) -> None:
    """torch.save stores its zip records uncompressed; `torch.load` inflates a deflated one in full,
    so a 3 MB file could ask for 3 GB (a "zip bomb" in a checkpoint someone sent). Refuse any
    compressed record, or one larger than the whole file, before `torch.load` (`data`: a path or a
    seekable binary file, left at its start)."""
    from disttrain.safefile import compressed_record

    if why := compressed_record(data):
        raise CorruptCheckpoint(f"{what}: {why}")


def algo_of(entry: dict[str, Any] | None) -> str | None:
    """The digest a manifest entry carries (None: sizes only); CorruptCheckpoint for a digest this
    version does not know (so that no caller takes such an entry for a sizes-only one)."""
    if entry is None:
        return None
    if why := entry_problem(entry):
        raise CorruptCheckpoint(f"a manifest entry {why}")
    return next((a for a in ALGOS if a in entry), None)


def file_digest(path: Path, algo: str | None) -> dict[str, Any]:
    """Size (and checksum) of a file as it is on disk: a manifest entry."""
    entry: dict[str, Any] = {"size": path.stat().st_size}
    if algo is not None:
        c, buf = Checksum(algo), bytearray(_CHUNK)
        with path.open("rb", buffering=0) as f:
            while n := f.readinto(buf):
                c.update(memoryview(buf)[:n])
        entry[algo] = c.hexdigest()
    return entry


def mismatch(path: Path, want: dict[str, Any], size: int, digest: str | None) -> str | None:
    """Why a file of `size` bytes and checksum `digest` is not the manifest's `want`, or None."""
    if size != want["size"]:
        return f"{path} has {size} bytes, the manifest says {want['size']} (truncated or overwritten)"
    algo = algo_of(want)
    if algo is not None and digest is not None and digest != want[algo]:
        return f"{path} has the right size but the wrong {algo} (corrupted)"
    return None


class _File:
    """One checkpoint file read in order of offset, checksummed as it goes when `want` is given."""

    def __init__(self, f: Any, want: dict[str, Any] | None) -> None:
        self.f, self.want = f, want
        algo = algo_of(want)
        self.sum = Checksum(algo) if algo is not None else None
        self.pos = 0  # bytes checksummed so far (all of [0, pos))

    def read_at(self, offset: int, n: int) -> bytes:
        """Bytes [offset, offset + n), checksummed when they are the next ones in the file."""
        self.skip_to(offset)
        self.f.seek(offset)
        data = self.f.read(n)
        if len(data) != n:
            raise CorruptCheckpoint(
                f"{self.f.name} ends at byte {offset + len(data)}; an item needs {offset + n}"
            )
        self._account(offset, data)
        return data

    def read_into(self, offset: int, out: memoryview) -> None:
        self.skip_to(offset)
        self.f.seek(offset)
        got = 0
        while got < out.nbytes:
            n = self.f.readinto(out[got:])
            if not n:
                raise CorruptCheckpoint(
                    f"{self.f.name} ends at byte {offset + got}; an item needs {offset + out.nbytes}"
                )
            got += n
        self._account(offset, out)

    def _account(self, offset: int, data: Any) -> None:
        if self.sum is not None and offset == self.pos:
            self.sum.update(data)
            self.pos += memoryview(data).nbytes

    def skip_to(self, offset: int) -> None:
        """Checksum the bytes this rank does not need, up to `offset` (only when verifying)."""
        if self.sum is None or offset <= self.pos:
            return
        self.f.seek(self.pos)
        while self.pos < offset and (chunk := self.f.read(min(_CHUNK, offset - self.pos))):
            self.sum.update(chunk)
            self.pos += len(chunk)

    def problem(self) -> str | None:
        if self.want is None or self.sum is None:
            return None
        self.skip_to(1 << 62)  # the rest of the file, to its end
        return mismatch(Path(self.f.name), self.want, self.pos, self.sum.hexdigest())


def _whole(meta: torch.Tensor, nbytes: int, req: Any, target: torch.Tensor) -> bool:
    """Whether the saved tensor can be read straight into `target`: the request is the whole
    saved tensor, both are plain contiguous CPU tensors of one dtype and shape."""
    return (
        type(meta) is torch.Tensor
        and meta.is_contiguous()
        and meta.storage_offset() == 0
        and meta.numel() * meta.element_size() == nbytes
        and all(o == 0 for o in req.storage_offsets)
        and tuple(req.lengths) == tuple(meta.shape)
        and target.device.type == "cpu"
        and target.dtype == meta.dtype
        and tuple(target.shape) == tuple(meta.shape)
        and target.is_contiguous()
        and type(target) is torch.Tensor
        and sys.byteorder == "little"
    )


def _read_file(reader: Any, rel: str, reqs: list[Any], planner: Any, lock: threading.Lock) -> str | None:
    """Every item of one file into the planner's tensors; returns the file's mismatch, if any."""
    path = reader.location / rel
    want = reader.expected.get(rel) if reader.expected is not None else None
    try:
        return _read_items(reader, path, want, reqs, planner, lock)
    except Exception:
        # bytes that fail to parse: when the file does not match its manifest, say that instead
        if want is not None and (why := _check_whole(path, want)):
            return why
        raise


def _read_items(
    reader: Any, path: Path, want: Any, reqs: list[Any], planner: Any, lock: threading.Lock
) -> str | None:
    from torch.distributed.checkpoint.planner import LoadItemType

    storage = reader.storage_data
    reqs = sorted(reqs, key=lambda r: storage[r.storage_index].offset)
    with open_regular(path) as raw:
        f = _File(raw, want)
        for req in reqs:
            info = storage[req.storage_index]
            if req.type == LoadItemType.BYTE_IO or info.transform_descriptors:
                _read_generic(reader, f, info, req, planner, lock)
                continue
            # the item's small records only: onto the meta device, torch.load reads no tensor bytes
            view = reader._slice_file(raw, info)
            meta = torch.load(view, map_location="meta", weights_only=True)
            st = meta.untyped_storage()
            start, nbytes = getattr(st, "_checkpoint_offset", None), st.nbytes()
            with lock:
                target = planner.resolve_tensor(req).detach()
            if start is None or not _whole(meta, nbytes, req, target):
                _read_generic(reader, f, info, req, planner, lock)
                continue
            if f.sum is not None:
                f.read_at(info.offset, start)  # the zip records before the tensor's bytes, summed
            if nbytes:
                f.read_into(info.offset + start, memoryview(target.reshape(-1).view(torch.uint8).numpy()))
            if f.sum is not None:
                f.read_at(info.offset + start + nbytes, info.length - start - nbytes)  # and after them
            with lock:
                planner.commit_tensor(req, target)
        return f.problem()


def _read_generic(reader: Any, f: _File, info: Any, req: Any, planner: Any, lock: threading.Lock) -> None:
    """DCP's own path for one item: its bytes, `torch.load`, narrow, `copy_` (or load_bytes)."""
    from torch.distributed._shard._utils import narrow_tensor_by_index as narrow
    from torch.distributed.checkpoint.planner import LoadItemType

    data = io.BytesIO(f.read_at(info.offset, info.length))
    stream = reader.transforms.transform_load_stream(req, info.transform_descriptors or (), data)
    value = io.BytesIO(stream.read(-1))
    refuse_compressed(value, f"{info.relative_path} item {req.storage_index.fqn}")
    if req.type == LoadItemType.BYTE_IO:
        with lock:
            planner.load_bytes(req, value)
        return
    tensor = narrow(
        torch.load(value, map_location="cpu", weights_only=True), req.storage_offsets, req.lengths
    )
    with lock:
        target = planner.resolve_tensor(req).detach()
    if target.size() != tensor.size():
        raise AssertionError(f"req {req.storage_index} mismatch sizes {target.size()} vs {tensor.size()}")
    target.copy_(tensor)
    with lock:
        planner.commit_tensor(req, target)


def read_data(reader: Any, plan: Any, planner: Any) -> Any:
    """The body of store's SafeReader.read_data (see the module docstring)."""
    per_file: dict[str, list[Any]] = {}
    for req in plan.items:
        per_file.setdefault(reader.storage_data[req.storage_index].relative_path, []).append(req)
    lock = threading.Lock()
    expected: dict[str, Any] = reader.expected or {}
    # The files no item of this rank's plan is in (.metadata, meta.json, rng files, other ranks'
    # shards): the checking rank hashes them in the same pool, beside the reads.
    unread = [n for n in expected if n not in per_file] if reader.check_unread else []
    workers = max(1, min(len(per_file) + len(unread), os.cpu_count() or 1, 4))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="disttrain-read") as pool:
        reads = [
            pool.submit(_read_file, reader, rel, reqs, planner, lock)
            for rel, reqs in sorted(per_file.items())
        ]
        checks = [pool.submit(_check_whole, reader.location / n, expected[n]) for n in unread]
        problems = [fut.result() for fut in reads + checks]
    why = next((p for p in problems if p), None)
    if why is not None:
        raise CorruptCheckpoint(why)
    from torch.futures import Future

    fut: Future[None] = Future()
    fut.set_result(None)
    return fut


def _check_whole(path: Any, want: dict[str, Any]) -> str | None:
    if not path.is_file():
        return f"{path} is missing"
    got = file_digest(path, algo_of(want))
    algo = algo_of(want)
    return mismatch(path, want, got["size"], got.get(algo) if algo else None)
