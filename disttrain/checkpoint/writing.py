"""A save: DCP shards written into `.tmp-<name>/` with their digests, in a background thread for
async saves (staging buffers kept between saves), then committed (`commit.commit_dir`)."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from disttrain.checkpoint import remote
from disttrain.checkpoint.commit import commit_dir
from disttrain.checkpoint.files import _bytes_digest, _HashingFile, _write_synced
from disttrain.checkpoint.layout import TMP, step_name
from disttrain.storage import ObjectPath

log = logging.getLogger("disttrain")


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


def settle(device: torch.device) -> None:
    """Before an async save stages the state: wait for the kernels queued on `device`'s current
    stream (the optimizer step writing the weights). DCP's stager copies on a stream of its own,
    from a thread, non-blocking, and never waits on the compute stream; with several ranks the
    save's barrier (NCCL) happens to order them, with one rank nothing does, and the checkpoint
    could hold weights half of the step wrote (review 2026-11-28-gpu G1). A no-op off CUDA."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


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
    ckpt_dir: Path | ObjectPath,
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
    _Background.finish()  # a save still in flight owns the staging buffers and its .tmp- folder
    with_hash, done = verify == "hash", tuple(protect)
    if isinstance(ckpt_dir, ObjectPath):  # an object store: written in place, committed by its manifest
        target = ckpt_dir / name
        if rank == 0:
            remote.prepare(ckpt_dir, name)
        put: Callable[[str, bytes], None] = target.put
        writer = _store_writer(target, with_hash)
        commit: Callable[[dict[str, Any]], Any] = functools.partial(
            remote.commit, ckpt_dir, name, meta, verify, keep, protect=done
        )
    else:
        tmp = ckpt_dir / f"{TMP}{name}"
        if rank == 0:
            ckpt_dir.mkdir(parents=True, exist_ok=True)
            for stale in ckpt_dir.glob(f"{TMP}*"):  # saves a crash interrupted: never committed
                remove_stale(stale)
            tmp.mkdir()
        put = functools.partial(_put_synced, tmp)
        writer = _writer(tmp, with_hash)
        commit = functools.partial(commit_dir, ckpt_dir, tmp, name, meta, verify, keep, protect=done)
    write = functools.partial(
        _write_and_commit, put, writer, commit, _torch_bytes(rng), rank, verify, process_group
    )
    barrier()
    if not async_save:
        write(app_state)
        pending = PendingSave(None, lambda: None, started)
        pending.wait()
        return pending
    device = device or torch.device("cpu")
    executor, stager = _Background.start(device)
    settle(device)
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


def _put_synced(folder: Path, fname: str, data: bytes) -> None:
    _write_synced(folder / fname, data)


def _write_and_commit(
    put: Callable[[str, bytes], None],
    writer: Any,
    commit: Callable[[dict[str, dict[str, Any]]], Any],
    rng_bytes: bytes,
    rank: int,
    verify: str,
    process_group: Any,
    state: dict[str, Any],
) -> None:
    """This rank's rng file (`put`) and DCP shards (`writer`, hashed while written), then rank 0
    gathers every rank's digests and commits them (`commit`: a folder's rename, a store's manifest)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    with_hash = verify == "hash"
    rng_name = f"rng_rank{rank}.pt"
    put(rng_name, rng_bytes)
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
    # so when rank 0's save returns, every shard and every rng file is on disk (in the store).
    if rank == 0:
        _test_pause("DISTTRAIN_TEST_SAVE_SLEEP")
        commit(digests)


# DCP's writer threads per rank (one file each); hashing and copying run in parallel on two cores.
WRITER_THREADS = 2


def _writer(path: Path, with_hash: bool = False) -> Any:
    """DCP's FileSystemWriter (fsyncing every file) whose files are hashed as they are written
    (`writer.fs.digests`: name -> manifest entry) and opened without following a symlink."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import FileSystem

    writer = checked_write(FileSystemWriter)(str(path), sync_files=True, thread_count=WRITER_THREADS)
    writer.fs = _hashing(FileSystem, with_hash, open_new=_open_nofollow)
    return writer


def _store_writer(target: ObjectPath, with_hash: bool) -> Any:
    """DCP's FsspecWriter whose files are summed as they are uploaded (`writer.fs.digests`)."""
    from torch.distributed.checkpoint._fsspec_filesystem import FileSystem, FsspecWriter

    # sync_files off: an object is durable once its upload ends (fsync has no file to sync; DCP
    # would fall back to os.sync() of the whole machine for every file)
    writer = checked_write(FsspecWriter)(target.url, sync_files=False, thread_count=WRITER_THREADS)
    fs = _hashing(FileSystem, with_hash)
    fs.fs = writer.fs.fs
    writer.fs = fs
    return writer


def _open_nofollow(path: str | os.PathLike, mode: str) -> Any:
    """A new file opened for writing without following a symlink at `path`."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.fdopen(os.open(path, flags, 0o666), mode)


def _hashing(
    base: type, with_hash: bool, open_new: Callable[[str | os.PathLike, str], Any] | None = None
) -> Any:
    """A DCP FileSystem (`base`: the local one or fsspec's) whose written files are summed as DCP
    writes them: `fs.digests` maps a file's name to its manifest entry, `fs.errors` keeps what
    DCP's writer threads raised (they drop it). `open_new(path, mode)` opens a file for writing
    (a context manager); by default the base's own `create_stream` does."""
    import threading

    class HashingFileSystem(base):
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
            try:
                with (open_new or super().create_stream)(path, mode) as f:
                    hashing = _HashingFile(f, with_hash)
                    yield hashing
            except BaseException as exc:  # DCP's extra writer threads drop their exceptions
                with self._lock:
                    self.errors.append(exc)
                raise
            with self._lock:
                self.digests[os.path.basename(os.fspath(path))] = hashing.digest()

        def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
            # DCP writes `.metadata.tmp`, then renames it (in a store: a copy)
            super().rename(path, new_path)
            old, new = os.path.basename(os.fspath(path)), os.path.basename(os.fspath(new_path))
            with self._lock:
                if (entry := self.digests.pop(old, None)) is not None:
                    self.digests[new] = entry

    return HashingFileSystem()


def checked_write(base: type) -> type:
    """`base` (DCP's FileSystemWriter or FsspecWriter) whose write fails when any writer thread
    failed: in torch 2.13 an exception in a thread other than the caller's is only printed, and its
    items would go missing. The writer's `fs` records those errors (`fs.errors`)."""

    class Writer(base):
        def write_data(self, plan: Any, planner: Any) -> Any:
            written = super().write_data(plan, planner)
            if self.fs.errors:
                raise self.fs.errors[0]
            if len(written.value()) != len(plan.items):
                raise RuntimeError(
                    f"DCP wrote {len(written.value())} of {len(plan.items)} items to {self.path}"
                )
            return written

    return Writer


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
