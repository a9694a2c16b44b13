"""What goes into a checkpoint, when, and how a run continues from one.

Torchtitan's shape: the manager is handed its state objects explicitly (anything `Stateful`:
state_dict / load_state_dict) and knows no trainer. In the sharded (DCP) checkpoint the keys of
`states["model"]` sit at the top level (torchtitan flattens its model the same way; `export`
reads `model.*` there) and every other state sits under its name; `states["train"]` (a
TrainState) goes into meta.json beside `run_info`, where `runs`, `resume` and the launchers read
it without opening the shards.
"""

from __future__ import annotations

import copy
import errno
import logging
import os
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from disttrain import checkpoint, storage
from disttrain.config.fingerprint import config_diff, config_hash, shaping_config
from disttrain.config.schema import CheckpointConfig
from disttrain.dist import DistEnv, default_store
from disttrain.rng import rng_state
from disttrain.shared_dir import checkpoint_dir
from disttrain.storage import ObjectPath
from disttrain.traps import warn_gloo_across_nodes

if TYPE_CHECKING:  # DCP (and DTensor with it) is imported at the first save or load, not at rank start
    from torch.distributed.checkpoint.stateful import Stateful

    from disttrain.config.run import Run

log = logging.getLogger("disttrain")

MODEL, TRAIN = "model", "train"


class ModelState:
    """Model and optimizer as one Stateful, through the strategy (which shards, renames, flattens).
    `optimizer` None: the model alone (eval, predict), and no optimizer state is built or read."""

    def __init__(
        self, strategy: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, ema: Any = None
    ) -> None:
        self.strategy, self.model, self.optimizer = strategy, model, optimizer
        self.ema = ema  # trainer.ema's averages, whose buffers are synchronised with the model's

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = self.strategy.state_dict(self.model, self.optimizer)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.strategy.load_state_dict(self.model, self.optimizer, state)

    def before_save(self) -> None:
        """One model in the checkpoint: the replicas' buffers made the same first (a collective)."""
        self.strategy.sync_buffers(self.model, self.ema.buffers() if self.ema is not None else ())


def _staged(state: Any) -> bool:
    """Whether an async save may stage `state` with the model (it changes only after the update)."""
    return bool(getattr(state, "staged_with_model", False))


def run_info(run: Run, strategy: str, world_size: int, dp_size: int, global_batch: int) -> dict[str, Any]:
    """What meta.json records about the run beside the train state: resume compares it with its own
    (the config as config.yaml holds it: its hash and its shaping keys)."""
    plain = run.to_dict()
    return {
        "dp_world_size": dp_size,
        "world_size": world_size,
        "global_batch": global_batch,
        "strategy": strategy,
        "config_hash": config_hash(plain),
        "config": shaping_config(plain),
    }


def _report_data_files(then: Any, now: Any) -> None:
    """A data file that changed size since the checkpoint: the resumed run's sample indices point
    at other tokens (and an epoch has another length) than the interrupted run's would have."""
    if not isinstance(then, dict) or not isinstance(now, dict) or then == now:
        return
    changes = [
        f"{path}: {then.get(path, 'absent')} -> {now.get(path, 'absent')} bytes"
        for path in sorted(set(then) | set(now))
        if then.get(path) != now.get(path)
    ]
    log.warning(
        "the training data changed since the checkpoint (%s): the resumed run reads other samples than "
        "the interrupted one would have, and an epoch has another length. HINT: resume with the files "
        "as they were for an exact continuation, or start a new run (init.path=<this checkpoint>) on "
        "the new data.",
        "; ".join(changes),
    )


class DiskFull(OSError):
    """A save failed because checkpoint.dir has no room left: said in those words."""


@contextmanager
def named_disk_full(directory: Path | ObjectPath) -> Iterator[None]:
    """A save that fails for lack of space says so, with the space free and the space a save needs.

    torch's zip writer turns ENOSPC into `RuntimeError: [enforce fail at inline_container.cc] .
    unexpected pos N vs M` (a short write), which names neither the disk nor the folder; DCP wraps
    it in a CheckpointException, a BaseException that the launchers' error recording (which takes
    Exceptions) never sees: the console then said only "exited with code 1 before Python could
    record an error". Any DCP failure leaves here as an Exception. The last good checkpoint stays:
    commits are atomic renames.
    """
    try:
        yield
    except DiskFull:
        raise
    except checkpoint.load_errors() as exc:
        if why := disk_full(exc, directory):
            raise DiskFull(errno.ENOSPC, why) from exc
        if not isinstance(exc, Exception):  # DCP's CheckpointException: recorded as the rank's error
            raise RuntimeError(f"checkpoint save into {directory} failed: {checkpoint.why_not(exc)}") from exc
        raise


FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
FULL_TEXTS = ("No space left", "Disk quota exceeded", "os error 28", "os error 122")


def out_of_room(exc: BaseException) -> bool:
    """Whether `exc` (or an exception it was raised from) says the disk or the quota is full."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if getattr(e, "errno", None) in FULL_ERRNOS or any(t in str(e) for t in FULL_TEXTS):
            return True
        e = e.__cause__ or e.__context__
    return False


def disk_full(exc: BaseException, directory: Path | ObjectPath) -> str | None:
    """The message for a save that failed on a full disk, or None when `exc` is something else."""
    import shutil

    if isinstance(directory, ObjectPath):  # a store has no disk to measure: its own error says why
        return None
    text = str(exc)
    full = out_of_room(exc)
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        return None
    need = last_checkpoint_bytes(directory)
    short_write = "unexpected pos" in text or "PytorchStreamWriter failed" in text
    if not full and not (short_write and need and free < need):
        return None
    return (
        f"checkpoint.dir {directory} is full: {_size(free)} free, a save needs ~{_size(need) if need else 'more'} "
        "(the last checkpoint's size). The previous checkpoint is intact. HINT: free space there, lower "
        "checkpoint.keep, or set checkpoint.dir to a larger volume, then `disttrain resume`."
    )


def free_bytes(directory: Path | ObjectPath) -> str:
    """The space free on `directory`'s disk, in words ("unknown" when it cannot be read)."""
    import shutil

    if isinstance(directory, ObjectPath):
        return "unknown (an object store)"
    try:
        return _size(shutil.disk_usage(directory).free)
    except OSError:
        return "unknown"


def last_checkpoint_bytes(directory: Path | ObjectPath) -> int:
    """The size of the newest committed checkpoint (0 when none)."""
    saved = checkpoint.committed(directory)
    if not saved:
        return 0
    return sum(f.stat().st_size for f in saved[-1].iterdir() if f.is_file())


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"


def resume_location(run: Run, run_dir: Path) -> Path | ObjectPath | None:
    """Where to continue from: a restart or resume=auto takes the run dir's own checkpoints first."""
    own = checkpoint_dir(run, run_dir)
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
    resume = run.resume
    if checkpoint.committed(own) and (resume == "auto" or restarted):
        return own
    if resume in (None, "auto", "never"):
        return None
    return storage.location(resume)


RANK_STATES = "rank_states"  # the key of the per-rank states in a rank's rng_rank<r>.pt


@dataclass
class Restored:
    path: Path | ObjectPath
    meta: dict[str, Any]
    rng: dict[str, Any] | None  # this rank's RNG states: set once the resumed epoch's iterator exists
    rank_states: list[str] = field(default_factory=list)  # the per-rank states restored (see Checkpointer)


class Checkpointer:
    """Sharded save/restore of the given state objects; async saves finish in the background."""

    def __init__(
        self,
        cfg: CheckpointConfig,
        directory: Path | ObjectPath,
        env: DistEnv,
        states: dict[str, Stateful],
        *,
        run_info: dict[str, Any] | None = None,
        barrier: Callable[[], None] = lambda: None,
        extra_meta: Callable[[], dict[str, Any]] = dict,
        rank_states: dict[str, Stateful] | None = None,
    ) -> None:
        self.cfg, self.dir, self.env = cfg, directory, env
        # States that differ by rank and are not tensors (a stream loader's position, per worker):
        # saved with this rank's RNG states in its own file, restored at the same data-parallel size.
        self.rank_states = dict(rank_states or {})
        self.train = states[TRAIN]
        self.states = {k: v for k, v in states.items() if k != TRAIN}  # the sharded part
        self.run_info = run_info or {}
        self.barrier, self.extra_meta = barrier, extra_meta
        self.async_save: bool = bool(getattr(cfg, "async"))
        self.pending: checkpoint.PendingSave | None = None
        self.last_saved_step = -1
        self.stalls: list[float] = []
        self.group: Any = None
        model = getattr(states.get(MODEL), "model", None)
        # Buffers a forward may change in place (BatchNorm's running stats): with any, an async
        # save's staging copy must end before the next forward, not just before the optimizer step.
        self._saved_buffers = model is None or any(
            name not in m._non_persistent_buffers_set
            for m in model.modules()
            for name, b in m._buffers.items()
            if b is not None
        )
        if self.async_save and dist.is_initialized() and env.world_size > 1:
            # A background save runs collectives; its own gloo group keeps them apart from training's.
            if env.local_rank == 0:
                warn_gloo_across_nodes("checkpoint.async's group", env.world_size, env.local_world_size)
            self.group = dist.new_group(backend="gloo")

    @property
    def step(self) -> int:
        return int(self.train.state_dict()["step"])

    def _app_state(self, names: Collection[str]) -> dict[str, Any]:
        app: dict[str, Any] = {}
        for name in names:
            sd = self.states[name].state_dict()
            if name == MODEL:
                app.update(sd)
            else:
                app[name] = sd
        return app

    # ------------------------------------------------------------------------------------ save
    def save(self, reason: str) -> None:
        """Every rank calls it at the same step. Logs and records the training stall."""
        step = self.step
        if step == self.last_saved_step and reason != "signal":
            return  # a signal stop re-saves: the launcher reports only a `signal` checkpoint as saved
        self.finish()  # at most one save in flight
        t0 = time.perf_counter()
        model = self.states.get(MODEL)
        if isinstance(model, ModelState):
            model.before_save()  # BatchNorm's running statistics: the replicas' mean
        app = self._app_state(self.states)
        meta = {
            **self.train.state_dict(),
            **self.run_info,
            "reason": reason,
            "time": time.time(),
            "torch": torch.__version__,
            "states": sorted(self.states),
            "has_scaler": "scaler" in self.states,
            **self.extra_meta(),  # rank 0: tracker run ids to continue
        }
        async_save = self.async_save and reason in ("periodic",)
        if async_save:
            # The staging copy overlaps the next step (see `staged`); the small states besides the
            # model and optimizer (scheduler, scaler, the user's own) are copied now, as they are.
            # A state that changes only after the optimizer step (the EMA) is staged with the model.
            app.update(
                {k: copy.deepcopy(app[k]) for k in self.states if k != MODEL and not _staged(self.states[k])}
            )
        with named_disk_full(self.dir):
            self.pending = checkpoint.save(
                self.dir,
                step,
                app,
                self._per_rank(),
                meta,
                rank=self.env.rank,
                keep=self.cfg.keep,
                verify=self.cfg.verify,
                async_save=async_save,
                overlap_staging=True,
                process_group=self.group,
                barrier=self.barrier,
                device=self.env.device,
                protect=self.protected(),
            )
        stall = time.perf_counter() - t0
        self.stalls.append(stall)
        self.last_saved_step = step
        log.info(
            "step %d: %s checkpoint %s (%s, training stalled %.3f s)",
            step,
            reason,
            checkpoint.step_name(step),
            "async" if async_save else "committed",
            stall,
        )

    def point_best(self) -> None:
        """After a validation that ranks among checkpoint.keep_best's at a step saved before it (the
        final checkpoint comes before the final validation): `best` names that checkpoint, once it
        is committed (an async save in flight points it when it commits)."""
        name = checkpoint.step_name(self.step)
        best = self.protected()
        due = self.env.is_zero and best[:1] == [name] and (self.dir / name).is_dir()
        if due and checkpoint.read_best(self.dir) != name:
            checkpoint.point_best(self.dir, name)

    def protected(self) -> list[str]:
        """checkpoint.keep_best's checkpoints, best first (TrainState.best): never pruned by keep."""
        return [checkpoint.step_name(int(step)) for _, step in getattr(self.train, "best", [])]

    def _per_rank(self) -> dict[str, Any]:
        """This rank's file: its RNG states, and its rank states under RANK_STATES (captured now)."""
        state = rng_state(self.env.device)
        if self.rank_states:
            state[RANK_STATES] = {name: obj.state_dict() for name, obj in self.rank_states.items()}
        return state

    def staged(self, before: str) -> None:
        """Called before the state changes (`before`: "forward" or "update", the optimizer step):
        waits until an async save's staging copy, which overlaps the step, has ended. Parameters,
        optimizer state and the scaler's scale change only in the update; saved buffers may change
        in a forward. The scheduler, TrainState and RNG were captured when the save started."""
        if self.pending is None or self.pending.is_staged():
            return
        if before == "forward" and not self._saved_buffers:
            return
        t0 = time.perf_counter()
        self.pending.wait_staged()
        if self.stalls:
            self.stalls[-1] += time.perf_counter() - t0  # training waited for it: part of the stall

    def finish(self) -> None:
        """Wait for an in-flight async save and commit it."""
        if self.pending is not None:
            t0 = time.perf_counter()
            with named_disk_full(self.dir):
                self.pending.wait()
            waited = time.perf_counter() - t0
            if waited > 0.05:
                log.info("waited %.3f s for the previous async checkpoint to finish", waited)
            self.pending = None

    def poll(self) -> None:
        """Commit a finished async save without waiting (rank 0 commits; others just drop it)."""
        if self.pending is not None and self.pending.ready():
            self.finish()

    def export_final(self, model_state: dict[str, torch.Tensor]) -> None:
        """checkpoints/final.pt: `{"model": state_dict, "step": N, "epoch": E}`, the consolidated
        model under "model": `model.load_state_dict(torch.load(path, weights_only=True)["model"])`.
        `model_state` is the strategy's full state dict (on rank 0, which writes; every rank calls this)."""
        if self.env.is_zero:
            train = self.train.state_dict()
            state = {"model": model_state, "step": train["step"], "epoch": train["epoch"]}
            with named_disk_full(self.dir):
                checkpoint.save_atomic(state, self.dir / "final.pt")
        self.barrier()

    # ------------------------------------------------------------------------------------ emergency
    def emergency(self, exc: BaseException, timeout_s: float) -> bool:
        """After an exception outside the optimizer update: save when every rank failed at the
        same step. Agreement goes through the rendezvous store with a short timeout, not a
        collective: a rank that did not fail is inside some other collective and would never match."""
        env, step = self.env, self.step
        if dist.is_initialized() and env.world_size > 1:
            store = default_store()
            key = f"disttrain/emergency/{step}"
            store.set(f"{key}/{env.rank}", type(exc).__name__)
            try:
                store.wait([f"{key}/{r}" for r in range(env.world_size)], timedelta(seconds=timeout_s))
            except Exception:
                log.error("not every rank failed at step %d: no emergency checkpoint", step)
                return False
        self.save("error")
        self.finish()
        return True

    # ------------------------------------------------------------------------------------ restore
    def choose(
        self, location: Path | ObjectPath, skip: Collection[Any] = (), fallback: bool = True
    ) -> Path | ObjectPath | None:
        """Rank 0 picks the newest checkpoint whose manifest and sizes check out and tells the other ranks."""
        box: list[Any] = [None]
        if self.env.is_zero:
            # verify=hash: sizes now, each file's checksum in the pass that `restore` loads it with
            found = checkpoint.choose(location, "size", skip, fallback)
            box = [str(found) if found else None]
        if dist.is_initialized() and self.env.world_size > 1:
            dist.broadcast_object_list(box, src=0)
        return storage.location(box[0]) if box[0] else None

    def resume(self, location: Path | ObjectPath) -> Restored | None:
        """Restore the newest checkpoint at `location` that every rank loads; None when none passes
        the manifest check. A load error on any rank (a bad pickle, garbage DCP metadata, a shape
        mismatch) is logged and every rank moves on to the previous checkpoint together."""
        restored = self.load(location)
        if restored is not None:
            self._supersede(restored.path)
        return restored

    def load(
        self, location: Path | ObjectPath, report: bool = True, fallback: bool = True
    ) -> Restored | None:
        """`resume` without moving later checkpoints aside: `disttrain eval`/`predict` read the
        checkpoint the user named and leave the run's timeline as it is (`report`: log what a
        training resume compares; an evaluation trains nothing, so there is nothing to compare).
        `fallback=False`: `location` is the one checkpoint the user named; it loads or this raises
        naming it, never an older one in its place."""
        failed: list[Any] = []
        while (path := self.choose(location, failed, fallback)) is not None:
            error, restored = "", None
            try:
                restored = self.restore(path, report)
            except checkpoint.load_errors() as exc:
                error = checkpoint.why_not(exc)
                if not checkpoint.pruned(path):
                    log.warning("rank %d cannot load checkpoint %s: %s", self.env.rank, path, error)
            if not self._any_rank(bool(error)) and restored is not None:
                return restored
            if not fallback:
                raise RuntimeError(f"checkpoint {path} is not loadable: {error or 'another rank failed'}")
            if self.env.is_zero:
                if checkpoint.pruned(path):  # its run is training: keep-N removed it while it was read
                    log.info("checkpoint %s was pruned while it was read; taking the next newest", path.name)
                else:
                    log.warning(
                        "checkpoint %s is not loadable on every rank; falling back to the previous one",
                        path.name,
                    )
            failed.append(path)
        if not fallback:
            why = checkpoint.problem(location, "size") or "it vanished"
            raise RuntimeError(f"checkpoint {location} is not loadable: {why}")
        if failed:
            # A failed load may have written part of the state: never train on from that.
            raise RuntimeError(
                f"no checkpoint under {location} could be loaded (tried {', '.join(p.name for p in failed)}; "
                "the ranks' logs name each error)"
            )
        return None

    def _any_rank(self, flag: bool) -> bool:
        t = torch.tensor([int(flag)], dtype=torch.int32, device=self.env.device)
        if dist.is_initialized() and self.env.world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def _supersede(self, path: Path | ObjectPath) -> None:
        """After resuming at step s, this run's checkpoints past s belong to an abandoned timeline:
        move them aside so that keep-N and the fallback never pick them over the new ones."""
        if not self.env.is_zero:
            return
        step = checkpoint.read_meta(path)["step"]
        for old in checkpoint.supersede(self.dir, step):
            log.warning(
                "resumed at step %d: %s (a later step of an abandoned timeline) moved to %s",
                step,
                old.name,
                old.parent.name + "/" + old.name,
            )

    def restore(self, path: Path | ObjectPath, report: bool = True) -> Restored:
        """Load every state from the checkpoint at `path`; a state it does not hold keeps its value."""
        meta = checkpoint.read_meta(path)
        saved = meta.get("states")
        if saved is None:  # older checkpoints: model, scheduler and (when flagged) scaler
            saved = [MODEL, "scheduler", *(["scaler"] if meta.get("has_scaler") else [])]
        names = [n for n in self.states if n in saved]
        app = self._app_state(names)
        rng = checkpoint.load_sharded(path, app, self.env.rank, verify=self.cfg.verify)
        for name in names:
            self.states[name].load_state_dict(app if name == MODEL else app[name])
        self.train.load_state_dict(meta)
        self.last_saved_step = self.step
        restored = self._restore_rank_states(rng.pop(RANK_STATES, None) if rng else None, meta)
        if rng is None:
            log.warning(
                "rank %d: the checkpoint has no RNG state for this rank; keeping the seeded one",
                self.env.rank,
            )
        if report:
            self._report(path, meta)
        return Restored(path, meta, rng, restored)

    def _restore_rank_states(self, saved: dict[str, Any] | None, meta: dict[str, Any]) -> list[str]:
        """Load the per-rank states this checkpoint holds for this rank, only when it was saved at
        this data-parallel size (rank r's position means nothing to another split of the data)."""
        if not saved or not self.rank_states:
            return []
        dp_then, dp_now = meta.get("dp_world_size"), self.run_info.get("dp_world_size")
        if dp_then is not None and dp_now is not None and dp_then != dp_now:
            return []
        names = [name for name in self.rank_states if name in saved]
        for name in names:
            self.rank_states[name].load_state_dict(saved[name])
        return names

    def _report(self, path: Path | ObjectPath, meta: dict[str, Any]) -> None:
        if not self.env.is_zero:
            return
        log.info(
            "resuming from %s: step %d, epoch %d, %d samples into the epoch (saved: %s)",
            path,
            meta["step"],
            meta["epoch"],
            meta["epoch_samples"],
            meta["reason"],
        )
        now = self.run_info
        if "config_hash" in now and meta.get("config_hash") != now["config_hash"]:
            diff = config_diff(meta.get("config", {}), now["config"])
            log.warning(
                "resuming with a different config than the checkpoint's (%s -> %s): %s",
                meta.get("config_hash"),
                now["config_hash"],
                "; ".join(diff) or "(keys not recorded)",
            )
        _report_data_files(meta.get("data_files"), now.get("data_files"))
        dp = int(now.get("dp_world_size", self.env.world_size))
        old = int(meta.get("dp_world_size", dp))
        if old != dp and now.get("data_stream"):  # a stream's position: the engine's own line says
            log.warning(
                "data-parallel world size %d -> %d: model and optimizer were resharded on load; global "
                "batch %d -> %d",
                old,
                dp,
                meta["global_batch"],
                now.get("global_batch", 0),
            )
        elif old != dp:
            pos = meta["epoch_samples"]
            skipped = pos % dp
            log.warning(
                "data-parallel world size %d -> %d: model and optimizer were resharded on load. Data "
                "order: epoch %d keeps its seeded permutation and continues at global sample %d; rank r "
                "now reads every %d-th sample from %d+r (was every %d-th); global batch %d -> %d%s",
                old,
                dp,
                meta["epoch"],
                pos,
                dp,
                pos - skipped,
                old,
                meta["global_batch"],
                now.get("global_batch", 0),
                f"; {skipped} samples re-read to align the ranks" if skipped else "",
            )
