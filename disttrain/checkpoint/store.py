"""Sharded checkpoints (torch.distributed.checkpoint), committed atomically, verified at load.

    <run dir>/checkpoints/
      step_00000017/         one committed checkpoint; a folder appears under this name only whole
        .metadata __0_0.distcp __1_0.distcp ...   DCP: model, optimizer, scheduler; shards per rank
        rng_rank0.pt ...     RNG states of each rank (torch.save; loaded with weights_only=True)
        meta.json            step, epoch, position inside the epoch, world size, config and its hash
        manifest.json        size and xxh3_64 of every file above (summed as each was written, by the
                             rank that wrote it; gathered on rank 0): written last, marks a whole save;
                             older versions' manifests carry crc32 or sha256 instead, still verified
      .tmp-step_00000020/    a save in progress (or one a crash interrupted: ignored, later removed)
      latest                 the newest committed checkpoint's name, replaced with os.replace
      final.pt               the consolidated model for plain PyTorch (checkpoint.export_final)
      superseded/step_N/     checkpoints past the step a run resumed from (an abandoned timeline)

A save writes into `.tmp-<name>/`, fsyncs every file, then renames the folder into place and
replaces `latest`: a kill at any instant leaves the previous checkpoint whole. An async save copies
the state into staging buffers kept between saves and does all of that in a background thread. A
load checks the manifest (sizes up front; with verify=hash, every file's checksum in the same pass
that reads it into the live tensors: `reading`) and falls back to the previous good checkpoint,
naming the bad file. Nothing is ever
unpickled freely: tensors and objects load with weights_only=True, DCP's `.metadata` through an
allow-list of DCP's own classes.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import pickle
import shutil
import tempfile
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from disttrain.checkpoint.reading import (
    XXH3,
    Checksum,
    CorruptCheckpoint,
    algo_of,
    entries_problem,
    file_digest,
    meta_problem,
    mismatch,
    refuse_compressed,
)
from disttrain.rundir import RunDir
from disttrain.safefile import default_mode

log = logging.getLogger("disttrain")

LATEST, MANIFEST, META = "latest", "manifest.json", "meta.json"
BEST = "best"  # checkpoint.keep_best: names the best checkpoint by checkpoint.monitor
PREFIX, TMP, SUPERSEDED = "step_", ".tmp-", "superseded"


def step_name(step: int) -> str:
    return f"{PREFIX}{step:08d}"


# --------------------------------------------------------------------------------- plain files
def save_atomic(state: dict[str, Any], path: Path) -> Path:
    """torch.save to a fresh temporary file, fsync, rename: the file at `path` is always whole.

    The temp name is random and created exclusively (never a planted symlink followed)."""
    from disttrain.safefile import write_atomic

    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda f: torch.save(state, f), sync=True)
    fsync_dir(path.parent)
    return path


def load(path: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    refuse_compressed(path, str(path))  # a deflated record would inflate in full
    state: dict[str, Any] = torch.load(path, map_location=map_location, weights_only=True)
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


# --------------------------------------------------------------------------------- DCP safety
# Exactly the globals DCP writes into `.metadata` (read off torch 2.13's own checkpoints): a pickle
# can call any global it names, so only these (module, name) pairs resolve, never a whole module.
# A dotted name (pickle protocol 4 walks attributes: `metadata` + "os.system" -> os.system) or a
# dunder never matches an entry, and torch's dtypes are looked up by exact name, not by getattr.
METADATA_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        *(
            ("torch.distributed.checkpoint.metadata", n)
            for n in (
                "Metadata",
                "MetadataIndex",
                "StorageMeta",
                "TensorProperties",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),  # a dict lookup of torch's layouts by name
        ("torch", "Size"),
        ("pathlib", "PosixPath"),
        ("pathlib", "Path"),
        ("collections", "OrderedDict"),
    }
)


@functools.cache
def _dtype_names() -> frozenset[str]:
    return frozenset(n for n, v in vars(torch).items() if isinstance(v, torch.dtype) and n.isidentifier())


class _SafeUnpickler(pickle.Unpickler):
    """DCP's `.metadata` is a pickle: resolve only the exact globals DCP itself writes there."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and name in _dtype_names():  # torch.float32, torch.bfloat16, ...
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is not allowed")


def _reader(path: Path, expected: dict[str, Any] | None = None, check_unread: bool = False) -> Any:
    """DCP's FileSystemReader with `.metadata` through the allow-list and `reading.read_data`:
    one thread per file, whole tensors read straight into the live ones, and each file checked
    against its manifest entry in `expected` (those it reads; with `check_unread`, the rest too)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    from disttrain.checkpoint import reading

    class SafeReader(FileSystemReader):
        expected: dict[str, Any] | None = None
        check_unread = False

        def read_data(self, plan: Any, planner: Any) -> Any:
            return reading.read_data(self, plan, planner)

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            rank = kwargs.get("rank")
            name = ".metadata" if rank is None else f"__{rank}.metadata"
            with (Path(self.path) / name).open("rb") as f:
                metadata = _SafeUnpickler(f).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    r = SafeReader(str(path))
    r.expected, r.check_unread = expected, check_unread
    return r


def _planner() -> Any:
    import io

    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.planner import ReadItem

    class SafeLoadPlanner(DefaultLoadPlanner):
        """DefaultLoadPlanner, but non-tensor values load with weights_only=True."""

        def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
            from torch.distributed.checkpoint._traverse import set_element

            refuse_compressed(value, f"item {read_item.dest_index.fqn}")
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafeLoadPlanner()


# --------------------------------------------------------------------------------- save
class PendingSave:
    """A save whose files are still being written (async) or committed; `wait()` finishes it."""

    def __init__(
        self, future: Future | None, commit: Callable[[], None], started: float, staged: Future | None = None
    ) -> None:
        self._future, self._commit, self.started, self._staged = future, commit, started, staged
        self.done = False

    def wait_staged(self) -> None:
        """Return once the state is copied (staged): from then on it may change again."""
        if self._staged is not None:
            self._staged.result()

    def is_staged(self) -> bool:
        return self._staged is None or self._staged.done()

    def wait(self) -> None:
        if self.done:
            return
        if self._future is not None:
            self._future.result()
        self._commit()
        self.done = True

    def ready(self) -> bool:
        return self._future is None or self._future.done()


class _Background:
    """The process's background checkpoint writer: one thread, DCP's DefaultStager (it keeps each
    tensor's staging copy between saves, so staging is a memcpy into memory already faulted in,
    never a fresh allocation) and the save in flight (at most one: its buffers are reused)."""

    executor: ThreadPoolExecutor | None = None
    stager: Any = None
    in_flight: PendingSave | None = None

    @classmethod
    def start(cls, device: torch.device) -> tuple[ThreadPoolExecutor, Any]:
        """The writer thread and the stager for tensors on `device` (one device per rank process)."""
        from torch.distributed.checkpoint.staging import DefaultStager

        if cls.executor is None:
            cls.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="disttrain-ckpt")
        if cls.stager is None or not stager_reusable(device):
            cls.stager = DefaultStager(staging_options(device))
        return cls.executor, cls.stager

    @classmethod
    def finish(cls) -> None:
        if cls.in_flight is not None:
            pending, cls.in_flight = cls.in_flight, None
            pending.wait()


def stager_reusable(device: torch.device, version: str = torch.__version__) -> bool:
    """Whether one DefaultStager serves every save. Not with non-blocking (CUDA) staging before
    torch 2.13: there `DefaultStager._stage` closes its `StateDictStager` after each stage, which
    empties its copy table, and the next save failed with `KeyError: <class 'type'>` (seen on an
    H100 with torch 2.11.0+cu130, 2026-11-25). There each save gets a fresh stager: its pinned
    buffers are allocated again, and the save is right."""
    major, minor = (int(part) for part in version.split(".")[:2])
    return device.type != "cuda" or (major, minor) >= (2, 13)


def staging_options(device: torch.device) -> Any:
    """How an async save copies the state off `device`, in DCP's staging thread (the copy overlaps
    the next step's forward and backward either way).

    CUDA: into pinned host buffers with non-blocking copies on DCP's own staging stream, so the
    device-to-host copy runs beside the training kernels; a pageable, blocking copy would run in
    line with them on the default stream (review 2026-11-25-gpu-readiness #13). Elsewhere: plain
    host memory and blocking copies (torch refuses non-blocking staging without an accelerator,
    and its `StateDictStager` ignores `pin_memory` without CUDA). Shared memory never: one writer
    process per rank.
    """
    from torch.distributed.checkpoint.staging import StagingOptions

    cuda = device.type == "cuda"
    return StagingOptions(
        use_pinned_memory=cuda,
        use_shared_memory=False,
        use_async_staging=True,
        use_non_blocking_copy=cuda,
    )


def save(
    ckpt_dir: Path,
    step: int,
    app_state: dict[str, Any],
    rng: dict[str, Any],
    meta: dict[str, Any],
    *,
    rank: int,
    keep: int,
    verify: str,
    async_save: bool = False,
    overlap_staging: bool = False,
    process_group: Any = None,
    barrier: Callable[[], None] = lambda: None,
    device: torch.device | None = None,
    protect: Sequence[str] = (),
) -> PendingSave:
    """Every rank calls this at the same step. Returns when the state is safe to modify again:
    sync, once committed; async, once staged (copied into CPU buffers kept from the previous async
    save), while a background thread writes and (rank 0) commits; `PendingSave.wait()` joins it.
    With `overlap_staging`, an async save returns while the copy is still running: the caller must
    call `PendingSave.wait_staged()` before anything in `app_state` changes (the optimizer step).
    `device`: where the rank's tensors live (async staging copies from there; None: the CPU).
    `protect`: checkpoint names keep-N never prunes (checkpoint.keep_best's, best first: `best`
    then names the first)."""
    started = time.time()
    name = step_name(step)
    tmp = ckpt_dir / f"{TMP}{name}"
    _Background.finish()  # a save still in flight owns the staging buffers and its .tmp- folder
    if rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        for stale in ckpt_dir.glob(f"{TMP}*"):  # saves a crash interrupted: never committed
            remove_stale(stale)
        tmp.mkdir()
    barrier()
    write = functools.partial(
        _write_and_commit,
        ckpt_dir,
        tmp,
        name,
        _torch_bytes(rng),
        meta,
        rank,
        keep,
        verify,
        process_group,
        protect=tuple(protect),
    )
    if not async_save:
        write(app_state)
        pending = PendingSave(None, lambda: None, started)
        pending.wait()
        return pending
    executor, stager = _Background.start(device or torch.device("cpu"))
    staged: Future = stager.stage(app_state)  # a Future: DCP's staging thread copies
    if not overlap_staging:
        staged.result()
    pending = PendingSave(executor.submit(lambda: write(staged.result())), lambda: None, started, staged)
    _Background.in_flight = pending
    return pending


def remove_stale(stale: Path) -> None:
    """Remove a `.tmp-*` entry a crash left, never following a link; one that cannot be removed
    (another user's, a planted link in a sticky folder) is renamed aside, so the save goes on."""
    import uuid

    if stale.is_symlink() or not stale.is_dir():
        with contextlib.suppress(OSError):
            stale.unlink()
    else:
        shutil.rmtree(stale, ignore_errors=True)
    if os.path.lexists(stale):
        aside = stale.with_name(f".stale-{uuid.uuid4().hex[:12]}")
        try:
            os.rename(stale, aside)
        except OSError as exc:
            raise OSError(
                f"cannot remove or move {stale} ({exc.strerror or exc}), left by an interrupted save: "
                "delete it, then resume"
            ) from exc
        log.warning("moved %s (it could not be removed) aside to %s", stale.name, aside.name)


def _write_and_commit(
    ckpt_dir: Path,
    tmp: Path,
    name: str,
    rng_bytes: bytes,
    meta: dict[str, Any],
    rank: int,
    keep: int,
    verify: str,
    process_group: Any,
    state: dict[str, Any],
    protect: tuple[str, ...] = (),
) -> None:
    """This rank's files (hashed while written), then rank 0 gathers every rank's digests and commits."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    with_hash = verify == "hash"
    rng_name = f"rng_rank{rank}.pt"
    _write_synced(tmp / rng_name, rng_bytes)
    writer = _writer(tmp, with_hash)
    no_dist = not dist.is_initialized()
    # torch.save's zip CRC32 of every tensor record is a second checksum of the same bytes: the
    # manifest's xxh3_64 (verify=hash) or size (verify=size) is what a load checks, and torch.load
    # never reads the CRC. The option is process-wide; it is restored as soon as the write ends.
    crc = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        dcp.save(state, storage_writer=writer, process_group=process_group, no_dist=no_dist)
    finally:
        torch.serialization.set_crc32_options(crc)
    digests = {rng_name: _bytes_digest(rng_bytes, with_hash), **writer.fs.digests}
    if not no_dist and dist.get_world_size(process_group) > 1:
        everyone: list[Any] | None = [None] * dist.get_world_size(process_group) if rank == 0 else None
        dist.gather_object(digests, everyone, dst=0, group=process_group)
        digests = {k: v for d in everyone or [] for k, v in d.items()}
    # DCP's last phase gathers every rank's write result on rank 0 before .metadata is written,
    # so when rank 0's save returns, every shard and every rng file is on disk.
    if rank == 0:
        _test_pause("DISTTRAIN_TEST_SAVE_SLEEP")
        commit_dir(ckpt_dir, tmp, name, meta, verify, keep, digests, protect)


# DCP's writer threads per rank (one file each); hashing and copying run in parallel on two cores.
WRITER_THREADS = 2


def _writer(path: Path, with_hash: bool = False) -> Any:
    """DCP's FileSystemWriter (fsyncing every file) whose files are hashed as they are written
    (`writer.fs.digests`: name -> manifest entry) and opened without following a symlink."""
    import contextlib
    import threading

    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import FileSystem

    class HashingFileSystem(FileSystem):
        def __init__(self) -> None:
            super().__init__()
            self.digests: dict[str, dict[str, Any]] = {}
            self.errors: list[BaseException] = []
            self._lock = threading.Lock()

        @contextlib.contextmanager
        def create_stream(self, path: str | os.PathLike, mode: str) -> Any:
            if mode != "wb":
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
            try:
                with os.fdopen(os.open(path, flags, 0o666), "wb") as f:
                    hashing = _HashingFile(f, with_hash)
                    yield hashing
            except BaseException as exc:  # DCP's extra writer threads drop their exceptions
                with self._lock:
                    self.errors.append(exc)
                raise
            with self._lock:
                self.digests[Path(path).name] = hashing.digest()

        def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
            super().rename(path, new_path)  # DCP writes `.metadata.tmp`, then renames it
            with self._lock:
                if (entry := self.digests.pop(Path(path).name, None)) is not None:
                    self.digests[Path(new_path).name] = entry

    class Writer(FileSystemWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            """DCP's write, failing when any writer thread failed: in torch 2.13 an exception in a
            thread other than the caller's is only printed, and its items would go missing."""
            written = super().write_data(plan, planner)
            if fs.errors:
                raise fs.errors[0]
            if len(written.value()) != len(plan.items):
                raise RuntimeError(
                    f"DCP wrote {len(written.value())} of {len(plan.items)} items to {self.path}"
                )
            return written

    fs = HashingFileSystem()
    writer = Writer(str(path), sync_files=True, thread_count=WRITER_THREADS)
    writer.fs = fs
    return writer


def _torch_bytes(obj: Any) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _test_pause(var: str) -> None:
    """Test hook: sleep inside a save (so a test can kill the process mid-write)."""
    seconds = float(os.environ.get(var, "0") or 0)
    if seconds > 0:
        log.warning("%s=%s: pausing inside the checkpoint write", var, seconds)
        time.sleep(seconds)


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


def point_latest(ckpt_dir: Path, name: str) -> None:
    """Replace `latest` through a fresh, randomly named temp file: a symlink planted at a
    predictable name (`.latest.tmp`) is never written through, and `latest` is a regular file."""
    from disttrain.safefile import write_atomic

    write_atomic(ckpt_dir / LATEST, (name + "\n").encode(), sync=True)
    fsync_dir(ckpt_dir)


def point_best(ckpt_dir: Path, name: str) -> None:
    """`best`: the name of the best checkpoint by checkpoint.monitor (written as `latest` is)."""
    from disttrain.safefile import write_atomic

    write_atomic(ckpt_dir / BEST, (name + "\n").encode(), sync=True)


def read_best(ckpt_dir: Path) -> str | None:
    try:
        return (ckpt_dir / BEST).read_text().strip() or None
    except OSError:
        return None


def committed(ckpt_dir: Path) -> list[Path]:
    """Committed checkpoint folders, oldest first (by step number in the name)."""
    if not ckpt_dir.is_dir():
        return []
    dirs = [p for p in ckpt_dir.iterdir() if p.is_dir() and p.name.startswith(PREFIX)]
    return sorted(dirs, key=lambda p: p.name)


def prune(ckpt_dir: Path, keep: int, protect: Collection[str] = ()) -> list[Path]:
    """Delete all but the newest `keep` committed checkpoints (never the one `latest` or `best`
    names, nor those in `protect`: checkpoint.keep_best's)."""
    spared = {read_latest(ckpt_dir), read_best(ckpt_dir), *protect}
    doomed = [p for p in committed(ckpt_dir)[:-keep] if p.name not in spared]
    for p in doomed:
        # rename first: a kill mid-delete leaves a .tmp- folder (ignored), never a half checkpoint
        trash = ckpt_dir / f"{TMP}del-{p.name}"
        os.rename(p, trash)
        shutil.rmtree(trash, ignore_errors=True)
    return doomed


def supersede(ckpt_dir: Path, step: int) -> list[Path]:
    """Move committed checkpoints past `step` into `superseded/` (a resume from `step` abandoned
    them); they stay on disk for the user but leave keep-N, `latest` and the fallback."""
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


def read_latest(ckpt_dir: Path) -> str | None:
    try:
        return (ckpt_dir / LATEST).read_text().strip() or None
    except OSError:
        return None


# --------------------------------------------------------------------------------- load
def problem(path: Path, verify: str = "hash") -> str | None:
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
    for fname, want in files.items():
        f = path / fname
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


def candidates(location: Path) -> list[Path]:
    """Checkpoints to try, best first: `location` itself, or a run/checkpoints dir's latest, then older."""
    if (location / MANIFEST).exists() or (location / ".metadata").exists():
        return [location, *reversed([p for p in committed(location.parent) if p.name < location.name])]
    own = RunDir(location).checkpoints
    ckpt_dir = own if own.is_dir() else location
    found = list(reversed(committed(ckpt_dir)))
    latest = read_latest(ckpt_dir)
    if latest and (ckpt_dir / latest).is_dir():
        found.sort(key=lambda p: p.name != latest)  # `latest` first; it may be older after a manual resume
    return found


def choose(location: Path, verify: str = "hash", skip: Collection[Path] = ()) -> Path | None:
    """The newest whole checkpoint at `location` not in `skip` (those failed to load); warns
    naming each bad file it passes over."""
    for path in candidates(location):
        if path in skip:
            continue
        why = problem(path, verify)
        if why is None:
            return path
        log.warning("checkpoint %s is not loadable: %s; falling back to the previous one", path.name, why)
    return None


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


def read_meta(path: Path) -> dict[str, Any]:
    """meta.json, checked (`meta_problem`): CorruptCheckpoint (a ValueError) names a bad field."""
    meta = json.loads((path / META).read_text())
    if why := meta_problem(meta):
        raise CorruptCheckpoint(f"{path / META} {why}")
    return dict(meta)


def dcp_metadata(path: Path) -> Any:
    """The DCP `.metadata` of the checkpoint at `path` (names, shapes, dtypes of every entry),
    through the allow-list: what a checkpoint holds, without reading a shard."""
    return _reader(path).read_metadata()


def load_sharded(
    path: Path, app_state: dict[str, Any], rank: int, no_dist: bool = False, verify: str = "size"
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
    try:
        dcp.load(app_state, storage_reader=reader, planner=_planner(), no_dist=no_dist)
    except dcp.CheckpointException as exc:  # DCP wraps each rank's error: name the corrupt file
        for failure in exc.failures.values():
            if isinstance(cause := failure[0] if isinstance(failure, tuple) else failure, CorruptCheckpoint):
                raise CorruptCheckpoint(str(cause)) from exc
        raise
    rng_file = path / f"rng_rank{rank}.pt"
    return load(rng_file) if rng_file.is_file() else None


# --------------------------------------------------------------------------------- export
class NoEMA(FileNotFoundError):
    """export --ema of a checkpoint that holds no EMA weights (trainer.ema.decay was off)."""


def ema_names(path: Path) -> list[str]:
    """The names of the EMA weights the checkpoint at `path` holds (`ema.weights.<name>`); NoEMA
    when it holds none."""
    prefix = "ema.weights."
    names = [
        k[len(prefix) :] for k in _reader(path).read_metadata().state_dict_metadata if k.startswith(prefix)
    ]
    if not names:
        raise NoEMA(f"checkpoint {path} holds no EMA weights (the run had trainer.ema.decay unset)")
    return names


def ema_entries(path: Path, model_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Empty tensors for the EMA weights the checkpoint at `path` holds, to load them into."""
    return {n: torch.empty_like(model_state[n]) for n in ema_names(path) if n in model_state}


def load_model(location: Path, model: torch.nn.Module, verify: str = "hash", ema: bool = False) -> Path:
    """Load the newest whole checkpoint at `location` into the plain `model` in one process; returns
    it. DCP reads each saved shard (an fsdp/tp run's, rank by rank) into its slice of the model's own
    tensors, in place: the shards are gathered into the model, not into a second copy of it.
    `ema`: then the averaged weights (trainer.ema) over the trained ones (NoEMA when there are none)."""
    import warnings

    failed: list[Path] = []
    while True:
        path = choose(location, verify, skip=failed)
        if path is None:
            raise FileNotFoundError(f"no loadable checkpoint under {location}")
        state: dict[str, Any] = {"model": model.state_dict()}
        if ema:
            state["ema"] = {"weights": ema_entries(path, state["model"])}
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
                load_sharded(path, state, rank=0, no_dist=True)
            model.load_state_dict(state["model"])
            if ema:  # only the averaged names: a tied alias (gpt's head) keeps the shared, averaged tensor
                model.load_state_dict(state["ema"]["weights"], strict=False)
            return path
        except load_errors() as exc:  # a pickle, DCP or shape error the manifest cannot see
            log.warning(
                "checkpoint %s is not loadable: %s; falling back to the previous one", path.name, why_not(exc)
            )
            failed.append(path)


def export_model(
    location: Path,
    out: Path,
    model: torch.nn.Module,
    verify: str = "hash",
    metadata: dict[str, str] | None = None,
    ema: bool = False,
) -> Path:
    """Load the newest whole checkpoint at `location` into the plain `model`; save one state dict.
    `ema`: the averaged weights (trainer.ema) in place of the trained ones where the EMA has them.

    `.safetensors` writes a safetensors file through `safetensors.torch.save_model`: a tensor shared
    by several names (tied embeddings) is stored once and `safetensors.torch.load_model` ties it
    back; `metadata` (strings) goes into its header. Anything else is a torch.save file.
    """
    path = load_model(location, model, verify, ema)
    tensors = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".safetensors":
        from safetensors.torch import save_model

        fd, name = tempfile.mkstemp(
            prefix=f".{out.name}.", suffix=".tmp", dir=out.parent
        )  # never a planted link
        os.close(fd)
        tmp = Path(name)
        try:
            save_model(model.cpu(), str(tmp), metadata={"checkpoint": str(path), **(metadata or {})})
            os.chmod(tmp, default_mode())  # mkstemp's 0600 would make the export owner-only
            os.replace(tmp, out)
        finally:
            tmp.unlink(missing_ok=True)
    else:
        save_atomic(tensors, out)
    log.info("exported %s (%d tensors) to %s", path, len(tensors), out)
    return path
