"""The engine's side of checkpoints: what goes into one, when, and how a run continues from one."""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from disttrain import checkpoint
from disttrain.dist import default_store
from disttrain.engine.resume import config_diff, config_hash, rng_state, shaping_config
from disttrain.shared_dir import checkpoint_dir

if TYPE_CHECKING:
    from disttrain.engine.loop import Engine

log = logging.getLogger("disttrain")


class Checkpointer:
    """Sharded save/restore of an Engine's full state; async saves finish in the background."""

    def __init__(self, engine: Engine, cfg: dict[str, Any], run_cfg: dict[str, Any]) -> None:
        self.e, self.cfg, self.run_cfg = engine, cfg, run_cfg
        self.dir = checkpoint_dir(run_cfg, engine.run_dir)  # checkpoint.dir, else <run dir>/checkpoints
        self.pending: checkpoint.PendingSave | None = None
        self.last_saved_step = -1
        self.stalls: list[float] = []
        self.group: Any = None
        if cfg.get("async") and dist.is_initialized() and engine.env.world_size > 1:
            # A background save runs collectives; its own gloo group keeps them apart from training's.
            self.group = dist.new_group(backend="gloo")

    # ------------------------------------------------------------------------------------ save
    def save(self, reason: str) -> None:
        """Every rank calls it at the same step. Logs and records the training stall."""
        e, s = self.e, self.e.state
        if s.step == self.last_saved_step and reason != "signal":
            return  # a signal stop re-saves: the launcher reports only a `signal` checkpoint as saved
        self.finish()  # at most one save in flight
        t0 = time.perf_counter()
        app = e.strategy.state_dict(e.model, e.optimizer)
        app["scheduler"] = e.scheduler.state_dict()
        if e.scaler is not None:
            app["scaler"] = e.scaler.state_dict()
        meta = {
            "step": s.step,
            "epoch": s.epoch,
            "epoch_samples": s.epoch_samples,
            "samples": s.samples,
            "dp_world_size": e.dp_size,
            "world_size": e.env.world_size,
            "global_batch": e.global_batch,
            "reason": reason,
            "time": time.time(),
            "strategy": e.strategy.name,
            "torch": torch.__version__,
            "config_hash": config_hash(self.run_cfg),
            "config": shaping_config(self.run_cfg),
            "last_val": s.last_val,
            "has_scaler": e.scaler is not None,
            "trackers": getattr(e.metrics, "tracker_state", dict)(),  # rank 0: tracker run ids to continue
        }
        async_save = bool(self.cfg.get("async")) and reason in ("periodic",)
        self.pending = checkpoint.save(
            self.dir,
            s.step,
            app,
            rng_state(),
            meta,
            rank=e.env.rank,
            keep=int(self.cfg.get("keep", 3)),
            verify=self.cfg.get("verify", "hash"),
            async_save=async_save,
            process_group=self.group,
            barrier=e.strategy.barrier,
        )
        stall = time.perf_counter() - t0
        self.stalls.append(stall)
        self.last_saved_step = s.step
        log.info(
            "step %d: %s checkpoint %s (%s, training stalled %.3f s)",
            s.step,
            reason,
            checkpoint.step_name(s.step),
            "async" if async_save else "committed",
            stall,
        )

    def finish(self) -> None:
        """Wait for an in-flight async save and commit it."""
        if self.pending is not None:
            t0 = time.perf_counter()
            self.pending.wait()
            waited = time.perf_counter() - t0
            if waited > 0.05:
                log.info("waited %.3f s for the previous async checkpoint to finish", waited)
            self.pending = None

    def poll(self) -> None:
        """Commit a finished async save without waiting (rank 0 commits; others just drop it)."""
        if self.pending is not None and self.pending.ready():
            self.finish()

    def export_final(self) -> None:
        """checkpoints/final.pt: the consolidated model a plain `torch.load` + load_state_dict takes."""
        e = self.e
        model_state = e.strategy.model_state_dict(e.model)  # a collective for sharded strategies
        if e.env.is_zero:
            state = {"model": model_state, "step": e.state.step, "epoch": e.state.epoch}
            checkpoint.save_atomic(state, self.dir / "final.pt")
        e.strategy.barrier()

    # ------------------------------------------------------------------------------------ emergency
    def emergency(self, exc: BaseException, timeout_s: float) -> bool:
        """After an exception: save when every rank failed at the same step outside the update.

        Agreement goes through the rendezvous store with a short timeout, not a collective: a rank
        that did not fail is inside some other collective and would never match ours.
        """
        e = self.e
        if e.in_update:
            log.error(
                "exception inside the optimizer update at step %d: no emergency checkpoint", e.state.step
            )
            return False
        if dist.is_initialized() and e.env.world_size > 1:
            store = default_store()
            key = f"disttrain/emergency/{e.state.step}"
            store.set(f"{key}/{e.env.rank}", type(exc).__name__)
            try:
                store.wait([f"{key}/{r}" for r in range(e.env.world_size)], timedelta(seconds=timeout_s))
            except Exception:
                log.error("not every rank failed at step %d: no emergency checkpoint", e.state.step)
                return False
        e.optimizer.zero_grad(set_to_none=True)
        self.save("error")
        self.finish()
        return True

    # ------------------------------------------------------------------------------------ restore
    def choose(self, location: Path, skip: Collection[Path] = ()) -> Path | None:
        """Rank 0 picks the newest checkpoint whose manifest and sizes check out and tells the other ranks."""
        e = self.e
        box: list[Any] = [None]
        if e.env.is_zero:
            # verify=hash: sizes now, each file's sha256 while `restore` loads it (load_sharded)
            found = checkpoint.choose(location, "size", skip)
            box = [str(found) if found else None]
        if dist.is_initialized() and e.env.world_size > 1:
            dist.broadcast_object_list(box, src=0)
        return Path(box[0]) if box[0] else None

    def resume(self, location: Path) -> Path | None:
        """Restore the newest checkpoint at `location` that every rank loads; None when none passes
        the manifest check. A load error on any rank (a bad pickle, garbage DCP metadata, a shape
        mismatch) is logged and every rank moves on to the previous checkpoint together."""
        failed: list[Path] = []
        while (path := self.choose(location, failed)) is not None:
            error = ""
            try:
                self.restore(path)
            except checkpoint.load_errors() as exc:
                error = checkpoint.why_not(exc)
                log.warning("rank %d cannot load checkpoint %s: %s", self.e.env.rank, path, error)
            if not self._any_rank(bool(error)):
                self._supersede(path)
                return path
            if self.e.env.is_zero:
                log.warning(
                    "checkpoint %s is not loadable on every rank; falling back to the previous one", path.name
                )
            failed.append(path)
        if failed:
            # A failed load may have written part of the state: never train on from that.
            raise RuntimeError(
                f"no checkpoint under {location} could be loaded (tried {', '.join(p.name for p in failed)}; "
                "the ranks' logs name each error)"
            )
        return None

    def _any_rank(self, flag: bool) -> bool:
        e = self.e
        t = torch.tensor([int(flag)], dtype=torch.int32, device=e.env.device)
        if dist.is_initialized() and e.env.world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def _supersede(self, path: Path) -> None:
        """After resuming at step s, this run's checkpoints past s belong to an abandoned timeline:
        move them aside so that keep-N and the fallback never pick them over the new ones."""
        if not self.e.env.is_zero:
            return
        step = checkpoint.read_meta(path)["step"]
        for old in checkpoint.supersede(self.dir, step):
            log.warning(
                "resumed at step %d: %s (a later step of an abandoned timeline) moved to %s",
                step,
                old.name,
                old.parent.name + "/" + old.name,
            )

    def restore(self, path: Path) -> None:
        e, s = self.e, self.e.state
        meta = checkpoint.read_meta(path)
        app = e.strategy.state_dict(e.model, e.optimizer)
        app["scheduler"] = e.scheduler.state_dict()
        if e.scaler is not None and meta.get("has_scaler"):
            app["scaler"] = e.scaler.state_dict()
        rng = checkpoint.load_sharded(path, app, e.env.rank, verify=self.cfg.get("verify", "hash"))
        e.strategy.load_state_dict(e.model, e.optimizer, app)
        e.scheduler.load_state_dict(app["scheduler"])
        if e.scaler is not None and "scaler" in app:
            e.scaler.load_state_dict(app["scaler"])
        s.step, s.epoch, s.samples = meta["step"], meta["epoch"], meta["samples"]
        s.epoch_samples = meta["epoch_samples"]
        s.last_val = dict(meta.get("last_val") or {})
        self.last_saved_step = s.step
        if rng is None:
            log.warning(
                "rank %d: the checkpoint has no RNG state for this rank; keeping the seeded one", e.env.rank
            )
        e.pending_rng = rng
        self._report(path, meta)

    def _report(self, path: Path, meta: dict[str, Any]) -> None:
        e = self.e
        if not e.env.is_zero:
            return
        log.info(
            "resuming from %s: step %d, epoch %d, %d samples into the epoch (saved: %s)",
            path,
            meta["step"],
            meta["epoch"],
            meta["epoch_samples"],
            meta["reason"],
        )
        if meta.get("config_hash") != config_hash(self.run_cfg):
            diff = config_diff(meta.get("config", {}), shaping_config(self.run_cfg))
            log.warning(
                "resuming with a different config than the checkpoint's (%s -> %s): %s",
                meta.get("config_hash"),
                config_hash(self.run_cfg),
                "; ".join(diff) or "(keys not recorded)",
            )
        old = int(meta.get("dp_world_size", e.dp_size))
        if old != e.dp_size:
            pos = meta["epoch_samples"]
            skipped = pos % e.dp_size
            log.warning(
                "data-parallel world size %d -> %d: model and optimizer were resharded on load. Data "
                "order: epoch %d keeps its seeded permutation and continues at global sample %d; rank r "
                "now reads every %d-th sample from %d+r (was every %d-th); global batch %d -> %d%s",
                old,
                e.dp_size,
                meta["epoch"],
                pos,
                e.dp_size,
                pos - skipped,
                old,
                meta["global_batch"],
                e.global_batch,
                f"; {skipped} samples re-read to align the ranks" if skipped else "",
            )
