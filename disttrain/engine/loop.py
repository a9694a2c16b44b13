"""The training loop: accumulate, clip, step, validate, log, checkpoint — the same for every strategy."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, default_collate

from disttrain.checkpoint.manager import Checkpointer
from disttrain.config.schema import TrainerConfig
from disttrain.data.loaders import loader_batches
from disttrain.data.streams import LOADER, first_samples, is_stream
from disttrain.dist import DistEnv, default_store
from disttrain.engine.ema import NullEMA
from disttrain.engine.guards import AnomalyError, DesyncError, Guards
from disttrain.engine.hangs import HangWatch, Progress, explain, frames_of_traceback
from disttrain.engine.monitor import Monitoring
from disttrain.engine.optim import total_steps as total_steps  # its home: the schedule's length
from disttrain.engine.signals import FAILED_KEY, StopFlag, StopUnagreed
from disttrain.engine.state import TrainState
from disttrain.observe import gpu_memory, host_memory
from disttrain.observe.metrics import NullMetrics
from disttrain.observe.phases import first_step_line
from disttrain.observe.profiler import NullProfiler
from disttrain.observe.progress import make_progress
from disttrain.observe.steptimes import StepClock
from disttrain.observe.throughput import Throughput, count_flops
from disttrain.rng import set_rng_state
from disttrain.storage import ObjectPath
from disttrain.strategies.base import Strategy
from disttrain.strategies.precision import Precision
from disttrain.tasks import Task
from disttrain.tasks import batch as batches

log = logging.getLogger("disttrain")


@dataclass
class Parts:
    """What the engine trains, built by the worker in nanoGPT order."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    task: Task
    train_loader: DataLoader
    val_loader: DataLoader | None = None


@dataclass
class Window:
    """Train metrics gathered between two log steps; reduced across ranks only when logged."""

    loss_sum: torch.Tensor
    steps: int = 0
    tokens: int | torch.Tensor = 0  # this rank's real tokens (language modelling), for tokens/s
    slots: int = 0  # this rank's row places, padding included (packed rows): data/pad_frac
    data_wait_s: float = 0.0
    started: float = field(default_factory=time.perf_counter)


class Engine:
    """The loop. Everything it uses is handed in: the typed trainer config, the ranks, the strategy,
    the parts it trains, where training is (`state`, which `ckpt` saves and restores), the metrics,
    the step guards and the profiler."""

    def __init__(
        self,
        trainer: TrainerConfig,
        env: DistEnv,
        strategy: Strategy,
        parts: Parts,
        *,
        state: TrainState,
        ckpt: Checkpointer,
        metrics: NullMetrics,
        guards: Guards,
        profiler: Any = None,
        timeout_s: float = 300.0,
        ema: NullEMA | None = None,
    ) -> None:
        self.t, self.env, self.strategy = trainer, env, strategy
        self.model, self.optimizer, self.scheduler, self.task = (
            parts.model,
            parts.optimizer,
            parts.scheduler,
            parts.task,
        )
        self.train_loader, self.val_loader = parts.train_loader, parts.val_loader
        self.state, self.ckpt, self.metrics, self.guards = state, ckpt, metrics, guards
        self.profiler = profiler if profiler is not None else NullProfiler()
        self.ema = ema if ema is not None else NullEMA()
        self.accum = trainer.grad_accum
        batches_per_epoch = loader_batches(self.train_loader)
        self.stream = batches_per_epoch is None  # an IterableDataset: steps until max_steps
        if self.stream:
            if trainer.max_steps < 1:
                raise ValueError("a stream (IterableDataset) trains for trainer.max_steps: set it")
            self.steps_per_epoch: int | None = None
            self.total_steps = trainer.max_steps
        else:
            assert batches_per_epoch is not None
            self.steps_per_epoch = batches_per_epoch // self.accum
            if self.steps_per_epoch < 1:
                raise ValueError(
                    f"{batches_per_epoch} batches per epoch on this rank cannot fill one step of "
                    f"grad_accum={self.accum}"
                )
            self.total_steps = total_steps(trainer, batches_per_epoch)
        self.empty_passes = 0  # consecutive passes over a stream that filled no step
        self.dp_size = strategy.data_parallel_rank_size()[1]
        self.global_batch = global_batch(trainer, self.dp_size)
        self.timeout_s = timeout_s
        self.precision: Precision = strategy.precision
        self.split = 1  # trainer.oom=auto_microbatch: each loader batch is cut into this many parts
        self.throughput = Throughput(
            strategy.unwrap(self.model),
            env,
            amp=self.precision.name,
            tf32=self.precision.tf32,
            gpus_per_rank=strategy.gpus_per_rank(),
        )
        self.data_wait_s = 0.0  # time spent waiting for batches (reset per log window)
        self.step_tokens: int | torch.Tensor = 0
        self.step_slots = 0
        self.in_update = False  # inside optimizer/scheduler step: state not consistent across ranks
        self.pending_rng: dict[str, Any] | None = None  # restored after the resumed epoch's iterator
        self.stop = StopFlag(lambda: self.state.step, timeout_s)
        self.monitoring = Monitoring(trainer.early_stop, ckpt.cfg, state)
        self.early_stop: str | None = None  # why training stops early (every rank the same)
        self.save_best = False  # this step's validation ranks among checkpoint.keep_best's
        self.validated_at = -1
        self.progress = Progress()  # the engine's collective sections, for the hang report
        self.hangs = HangWatch(self.progress, env.rank, env.world_size, timeout_s)
        self.step_clock = StepClock(env.device)  # this rank's step times, for p50/p95
        self.step_began: Any = None  # the step clock's mark at the start of the group's data wait

    # ------------------------------------------------------------------------------------ resume
    def resume(self, location: Path | ObjectPath | None) -> Path | ObjectPath | None:
        """Continue from the newest checkpoint at `location` that every rank loads (None, or none
        there: a fresh start). Restores every state, keeps this rank's RNG states for the resumed
        epoch's iterator, and starts the metrics at the checkpoint's step (metrics.jsonl cut back
        to it, tracker runs continued). Returns the checkpoint restored."""
        restored = self.ckpt.resume(location) if location is not None else None
        if restored is not None:
            self.pending_rng = restored.rng
            if self.stream and LOADER not in restored.rank_states:
                log.warning(
                    "data.train is a stream whose position %s: the resumed run will not replay the same "
                    "samples (it reads the stream from its start)",
                    "is not in the checkpoint (saved without it, or at another data-parallel size)"
                    if LOADER in self.ckpt.rank_states
                    else "is not saved (data.stateful=false, torchdata missing, or workers over a stream "
                    "without its own state_dict)",
                )
        self.metrics.start(restored.meta if restored is not None else None)
        return restored.path if restored is not None else None

    # ------------------------------------------------------------------------------------ fit
    def fit(self) -> dict[str, Any]:
        with host_memory.frozen_heap():  # the setup's objects out of the collector's way
            return self._fit()

    def _fit(self) -> dict[str, Any]:
        s, t = self.state, self.t
        started = time.perf_counter()
        self.early_stop = self.monitoring.stopped  # a resumed run that had stopped early trains no more
        resumed_done = (s.step >= self.total_steps and s.step > 0) or self.early_stop is not None
        self.metrics.start(None)  # opened by resume() already, unless the caller skipped it
        epochs = None if self.steps_per_epoch is None else -(-self.total_steps // self.steps_per_epoch)
        progress = make_progress(self.env.is_zero, t.progress, self.total_steps, "train", epochs)
        gpu_memory.reset_peaks(self.env)
        host_memory.reset_peak()
        # Every module in training mode once, as a hand-written loop's model.train(): a submodule the
        # model's own __init__ left in eval mode trains as after a validation (train_step turns the
        # model back only when its top module is not training), and as a resumed run's new model.
        self.model.train()
        with self.stop, self.hangs, self.profiler, progress as bar:
            bar.update(s.step)
            try:
                if t.val_at_start and s.step == 0:
                    self.validate()  # the loss the run starts from (init.path: the source's)
                self._epochs(bar)
            except Exception as exc:
                raise self._failed(exc) from exc
        if self.stop.agreed:
            return self._stopped(time.perf_counter() - started)
        if not resumed_done:
            if self.early_stop:  # localsgd: average the replicas, as after the last step
                self.strategy.end_of_training(self.model)
            self.ckpt.save("final")  # (after the last step: saved there already) then what can fail
            if (not t.val_every or s.step % t.val_every != 0) and self.validated_at != s.step:
                self.validate()  # val_every=0: the last epoch ended here (the loop returns before its end)
                self._save_best()
            if self.ckpt.cfg.export_final:
                self.ckpt.export_final(self.strategy.model_state_dict(self.model))  # a collective
        self.ckpt.finish()
        return self._summary(time.perf_counter() - started)

    def _epochs(self, bar: Any) -> None:
        s, t = self.state, self.t
        window = self._new_window()
        while s.step < self.total_steps and not self.early_stop:
            self._set_epoch(s.epoch)
            for micro_batches in self._groups():
                with self.progress.section(f"{self.strategy.name} train step", s.step + 1):
                    loss, grad_norm = self._step_fitting_memory(micro_batches)
                self.step_clock.end(self.step_began)  # its data wait and itself
                self.profiler.step()
                s.step += 1
                s.samples += self.global_batch
                s.epoch_samples += self.global_batch
                if s.step == self.total_steps:
                    self.strategy.end_of_training(self.model)  # localsgd: average the replicas
                window.loss_sum += loss
                window.steps += 1
                window.tokens += self.step_tokens
                window.slots += self.step_slots
                # packed rows count their real tokens on the device: the bar gets the row places
                # (no wait for the device every step); tokens_per_s in the metrics is real tokens
                shown = self.step_tokens if isinstance(self.step_tokens, int) else self.step_slots
                bar.advance(s.step, s.epoch, self.global_batch, shown * self.dp_size)
                if s.step % t.log_every == 0 or s.step == self.total_steps:
                    values, ended = self._log_train(window, grad_norm)
                    window = self._new_window(ended)  # the log step's own work counts in the next
                    bar.update(
                        s.step,
                        loss=values["train/loss"],
                        lr=values["lr"],
                        samples_per_s=values["samples_per_s"],
                    )
                if s.step == self.total_steps:
                    # Save first, then do what can fail: the trained model is on disk before the
                    # final validation (a task's collective, an uneven batch) can lose it.
                    self.ckpt.save("final")
                if t.val_every and s.step % t.val_every == 0:
                    self.validate()
                if t.ckpt_every and s.step % t.ckpt_every == 0:
                    with self.progress.section("checkpoint save", s.step):
                        self.ckpt.save("periodic")
                self._save_best()
                self.ckpt.poll()
                # Every step, at no cost to it (an attribute read until a rank is signalled).
                if s.step >= self.total_steps or self.early_stop or self.stop.should_stop(s.step):
                    return
            s.epoch += 1
            s.epoch_samples = 0
            if not t.val_every and not self.stream:  # a stream ends on each rank at its own step
                self.validate()
                self._save_best()
                if self.early_stop:
                    return

    def _save_best(self) -> None:
        """A checkpoint at this step: its validation ranks among checkpoint.keep_best's (a save at
        this step already made, periodic or final, is that checkpoint)."""
        if self.save_best:
            self.save_best = False
            self.ckpt.save("best")
            self.ckpt.point_best()  # a step saved before its validation: the final checkpoint

    def _stopped(self, elapsed: float) -> dict[str, Any]:
        log.warning("stopping at step %d on %s", self.state.step, self.stop.name)
        if self.ckpt.cfg.on_signal:
            self.ckpt.save("signal")
        self.ckpt.finish()
        summary = self._summary(elapsed)
        summary["stopped_by"] = self.stop.name
        return summary

    def _failed(self, exc: Exception) -> Exception:
        """Name a dead or hung peer plainly; save an emergency checkpoint when every rank failed."""
        text = str(exc)
        if isinstance(exc, StopUnagreed):
            return exc  # the launcher is gone: nothing to coordinate a save with
        if any(m in text for m in ("Timed out", "timed out", "Timeout")):
            return self._timed_out(exc)
        if isinstance(exc, (AnomalyError, DesyncError)):
            return exc  # no emergency save: NaN gradients or diverged replicas are not worth keeping
        if isinstance(exc, dist.DistError) or any(
            m in text for m in ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
        ):
            return RuntimeError(
                f"rank {self.env.rank}: a peer rank died at step {self.state.step + 1} "
                f"({text.splitlines()[0][:200] if text else type(exc).__name__})"
            )
        if self.state.step in (0, self.ckpt.last_saved_step):  # untrained, or already saved as is
            log.error("no optimizer step since the start or the last checkpoint: no emergency checkpoint")
        elif self.ckpt.cfg.on_error:
            self._emergency(exc)
        return exc

    def _timed_out(self, exc: Exception) -> RuntimeError:
        """One paragraph: who stopped participating, which ranks wait in which collective, and
        where the others are (their Where records, engine/hangs.py)."""
        self.hangs.write(self.hangs.where(frames_of_traceback(exc.__traceback__), waiting=True))
        hung = self._stragglers()
        records = self.hangs.records(wait_s=1.0 if hung else 0.0)
        why = "" if records else ": hung, stopped or much slower"  # else the records say
        who = (
            f"rank(s) {hung} stopped participating (no timeout of their own within "
            f"{self.STRAGGLER_GRACE_S:g} s{why})"
            if hung
            else "another rank stopped participating (hung, stuck or much slower)"
        )
        said = explain(records, hung)
        detail = f" {said[:1].upper()}{said[1:]}." if said else ""
        where = f"rank {hung[0]}'s log (its Python stacks)" if hung else "the other ranks' logs"
        return RuntimeError(
            f"rank {self.env.rank}: a collective at step {self.state.step + 1} waited more than "
            f"backend.timeout={self.timeout_s:g} s: {who}.{detail} HINT: look at {where}; raise "
            "backend.timeout if a step can legitimately take that long."
        )

    def _emergency(self, exc: Exception) -> None:
        """Save after an exception, unless it came inside the update (state not consistent)."""
        if self.in_update:
            log.error(
                "exception inside the optimizer update at step %d: no emergency checkpoint", self.state.step
            )
            return
        try:
            self.optimizer.zero_grad(set_to_none=True)
            if self.ckpt.emergency(exc, min(self.timeout_s, 5.0)):
                log.error("saved an emergency checkpoint at step %d", self.state.step)
        except Exception:
            log.exception("the emergency checkpoint failed")

    STRAGGLER_GRACE_S = 5.0

    def _stragglers(self) -> list[int]:
        """After a collective timed out here: the ranks that did not time out too. Every rank
        that waits reports its timeout in the store; a rank that hangs in its own code, or is
        stopped or dead, never does. Costs nothing until a timeout (bounded by the grace)."""
        if not (dist.is_initialized() and self.env.world_size > 1):
            return []
        try:
            store = default_store()
            store.set(f"{FAILED_KEY}/rank{self.env.rank}", str(self.state.step + 1))
            store.set(FAILED_KEY, str(self.env.rank))  # a hung rank's SIGTERM handler exits at once
            keys = {r: f"{FAILED_KEY}/rank{r}" for r in range(self.env.world_size)}
            deadline = time.monotonic() + self.STRAGGLER_GRACE_S
            while time.monotonic() < deadline:
                missing = [r for r, k in keys.items() if not store.check([k])]
                if not missing:
                    return []
                time.sleep(0.2)
            return missing
        except Exception:  # the store itself is gone: no names, the plain message
            return []

    # ------------------------------------------------------------------------------------ step
    def train_step(self, micro_batches: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over `grad_accum` micro-batches; all-reduce only on the last."""
        self.ckpt.staged("forward")  # an async save's staging copy overlaps the step, ends before changes
        if not self.model.training:  # after a validation (fit sets the whole model training first)
            self.model.train()
        total: torch.Tensor | None = None
        n = len(micro_batches)
        self.step_tokens, self.step_slots = 0, 0
        for i, batch in enumerate(micro_batches):
            inputs, target = self.task.unpack(batches.to_device(batch, self.env.device))
            self.step_tokens += self.task.tokens(inputs, target)
            self.step_slots += self.task.slots(inputs, target)
            with self.strategy.no_backward_sync(self.model, enabled=i < n - 1):
                loss = self.strategy.forward_backward(self.model, inputs, target, self.task, scale=1.0 / n)
            total = loss if total is None else total + loss
        assert total is not None  # a step has at least one micro-batch
        self.precision.unscale(self.optimizer)  # clipping and the norm see the true gradients
        grad_norm = self.strategy.clip_grad_norm(self.model, self.t.clip_grad_norm)
        if (self.state.step + 1) % self.t.log_every == 0 and (norms := self.guards.grad_norms()):
            self.metrics.log(self.state.step + 1, norms, epoch=self.state.epoch)
        skip = self.guards.after_backward(self.state.step + 1, total, grad_norm)
        self.ckpt.staged("update")
        self.in_update = True
        if skip:
            self.precision.scaler.update()
        else:
            self.precision.step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        self.guards.after_step(self.state.step + 1)
        self.state.lr = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step()
        self.ema.update(self.state.step + 1)
        self.in_update = False
        if self.state.first_step_at is None:
            self.state.first_step_at = time.time()
            if self.env.is_zero and (said := first_step_line(self.state.first_step_at)):
                log.info("%s", said)
        return total, grad_norm

    def _counted_step(self, micro_batches: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """The first step of a model without a FLOPs formula runs under FlopCounterMode (the real
        step: nothing changes in it but a little Python per op), and its FLOPs, summed over ranks,
        become every later window's FLOPs per step; under torch.compile that step runs eagerly
        (`count_flops`). Not with one rank driving several GPUs (strategy=dp's replica threads
        escape the counter), nor under pipeline (Strategy.flops_countable); by default only where
        the device's peak is known (trainer.count_flops: the first use costs a rank ~0.4 CPU-s)."""
        counted = self.strategy.flops_countable and self.strategy.gpus_per_rank() == 1
        wanted = self.t.count_flops if self.t.count_flops is not None else self.throughput.peak is not None
        if not self.throughput.needs_count or not counted or not wanted:
            return self.train_step(micro_batches)
        out, flops = count_flops(lambda: self.train_step(micro_batches))
        total = torch.tensor(float(flops), dtype=torch.float64, device=self.env.device)
        if dist.is_initialized() and self.env.world_size > 1:
            dist.all_reduce(total)  # every rank runs the first step (pipeline stages count their own)
        self.throughput.flops_per_step = total.item() / self.strategy.flops_copies()
        return out

    def _step_fitting_memory(self, micro_batches: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """trainer.oom=auto_microbatch: after an out-of-memory error, cut every micro-batch in two
        (micro-batch / 2, grad_accum x 2: the same samples, the same mean gradient) and retry.
        Only strategies without collectives inside a step allow it (StrategySpec.oom_retry: single,
        dp): elsewhere a failed rank would leave DDP's reducer or its peers mid-collective."""
        while True:
            try:
                return self._counted_step(split_batches(micro_batches, self.split))
            except torch.OutOfMemoryError as exc:
                if self.t.oom != "auto_microbatch":
                    raise
                self.optimizer.zero_grad(set_to_none=True)
                samples = batches.leading_size(micro_batches[0])
                size = samples // self.split
                if size <= 1:
                    raise RuntimeError(
                        f"trainer.oom=auto_microbatch: out of memory at step {self.state.step + 1} on rank "
                        f"{self.env.rank} even with a micro-batch of 1 sample: the model does not fit. "
                        "HINT: use strategy=fsdp (sharded state), trainer.activation_checkpointing=true, "
                        "amp=bf16, or a smaller model."
                    ) from exc
                self.split *= 2
                log.warning(
                    "rank %d: out of memory at step %d; micro-batch %d -> %d, grad_accum %d -> %d "
                    "(global batch unchanged)",
                    self.env.rank,
                    self.state.step + 1,
                    size,
                    samples // self.split,
                    self.accum * self.split // 2,
                    self.accum * self.split,
                )

    def validate(self) -> dict[str, float]:
        """Loss and metric over the whole validation set, weighted by sample counts across ranks;
        with trainer.ema, the averaged weights' too (`val_ema/*`, swapped in and out again)."""
        with self.progress.section("validation", self.state.step):
            return self._validate()

    @torch.no_grad()
    def _validate(self) -> dict[str, float]:
        if self.val_loader is None:
            return {}
        # One model on every replica: BatchNorm's statistics (and the EMA's of them) averaged.
        self.strategy.sync_buffers(self.model, self.ema.buffers())
        values = validation(
            self.strategy, self.model, self.task, self.val_loader, self.env.device, self.t.val_batches
        )
        if not values:  # no sample on any rank: a loss of 0.0 would read as a perfect model
            log.warning(
                "step %d: the validation set is empty (0 samples on every rank): no val metrics recorded",
                self.state.step,
            )
            return {}
        values.update(self._validate_ema())
        self.state.last_val = values
        self.metrics.log(self.state.step, values, epoch=self.state.epoch)
        log.info("step %d val: %s", self.state.step, " ".join(f"{k}={v:.4f}" for k, v in values.items()))
        self.validated_at = self.state.step
        best, stop = self.monitoring.after_validation(self.state.step, values)  # the same on every rank
        self.save_best = self.save_best or best
        if stop:
            self.early_stop = stop
            log.warning("step %d: stopping early: %s", self.state.step, stop)
        return values

    def _validate_ema(self) -> dict[str, float]:
        """`val_ema/*`: the validation of the EMA's weights, swapped into the model and back (none
        before the EMA's first update)."""
        if not self.ema.active:
            return {}
        assert self.val_loader is not None
        self.strategy.reshard(self.model)  # fsdp: gather the swapped shards, not the last full weights
        with self.ema.swapped_in():
            values = validation(
                self.strategy, self.model, self.task, self.val_loader, self.env.device, self.t.val_batches
            )
            self.strategy.reshard(self.model)  # and train on the model's own again
        return {k.replace("val/", "val_ema/", 1): v for k, v in values.items()}

    # ------------------------------------------------------------------------------------ helpers
    def _groups(self) -> Iterator[list[Any]]:
        """The rest of this epoch's optimizer steps, each `grad_accum` micro-batches."""
        batches = iter(self.train_loader)
        if self.pending_rng is not None:  # after iter(): the interrupted run drew from the RNG there too
            set_rng_state(self.pending_rng, self.env.device)
            self.pending_rng = None
        if self.stream:
            yield from self._stream_groups(batches)
            return
        for _ in range(len(self.train_loader) // self.accum):
            self.step_began = self.step_clock.begin()  # a step's time starts with its data wait
            t0 = time.perf_counter()
            group = [next(batches) for _ in range(self.accum)]
            self.data_wait_s += time.perf_counter() - t0
            yield group

    def _stream_groups(self, batches: Iterator[Any]) -> Iterator[list[Any]]:
        """A stream's steps until it ends (a last incomplete group is dropped). Two passes in a row
        without one step (the first may be the tail of a resumed pass) mean a stream too short."""
        filled = False
        while True:
            self.step_began = self.step_clock.begin()  # a step's time starts with its data wait
            t0 = time.perf_counter()
            group = list(itertools.islice(batches, self.accum))
            self.data_wait_s += time.perf_counter() - t0
            if len(group) < self.accum:
                break
            filled = True
            yield group
        self.empty_passes = 0 if filled else self.empty_passes + 1
        if self.empty_passes >= 2:
            raise ValueError(
                f"rank {self.env.rank}: a whole pass over the data.train stream gave fewer than "
                f"grad_accum={self.accum} batches of trainer.batch_size={self.t.batch_size}: it yields "
                "too little for this rank (is it split across more ranks/workers than it has parts?)"
            )

    def _set_epoch(self, epoch: int) -> None:
        """Seed the epoch's permutation; a resumed epoch starts after the samples already consumed."""
        if self.stream:
            return  # a stream keeps its own position (the loader's state, restored on resume)
        sampler = self.train_loader.sampler
        set_epoch = getattr(sampler, "set_epoch", None)
        if set_epoch is not None:
            set_epoch(epoch)
        set_start = getattr(sampler, "set_start", None)
        if set_start is not None:
            set_start(self.state.epoch_samples // self.dp_size)
        elif self.state.epoch_samples:
            raise ValueError(
                f"resuming mid-epoch needs a sampler with set_start(); {type(sampler).__name__} has none"
            )

    def _new_window(self, started: float | None = None) -> Window:
        window = Window(loss_sum=torch.zeros((), device=self.env.device))
        if started is not None:
            window.started = started
        return window

    def _log_train(self, window: Window, grad_norm: torch.Tensor) -> tuple[dict[str, float], float]:
        """The window's metrics, logged; and the time it ended, where the next window starts.

        The window ends after the device has finished its queued work: the loss `.item()` waits for
        everything queued before it on the device's stream (the window's loss sum is added after each
        step's update), so the clock is read after it. Read before it, the queued work a GPU-bound
        run still has (up to about a step) would count in no window (review G2)."""
        with self.progress.section("all_reduce(train/loss)", self.state.step):
            mean = self.strategy.all_reduce(window.loss_sum / window.steps, op="mean")
            drain = time.perf_counter()
            loss = mean.item()
        ended = time.perf_counter()
        self.step_clock.synced(window.steps, ended - drain)  # the steps' times hold the drain
        elapsed = ended - window.started
        values = {
            "train/loss": loss,
            "lr": self.state.lr,
            "grad_norm": float(grad_norm),
            "samples_per_s": window.steps * self.global_batch / max(elapsed, 1e-9),
            "step_time_s": elapsed / window.steps,
            "data_wait_frac": min(1.0, self.data_wait_s / max(elapsed, 1e-9)),
            "micro_batch": float(-(-self.t.batch_size // self.split)),
        }
        self.data_wait_s = 0.0
        values.update(self.task.derived(values))
        tokens = int(window.tokens)
        values.update(
            self.throughput.rates(tokens * self.dp_size, elapsed, window.steps, window.slots * self.dp_size)
        )
        if window.slots:
            values["data/pad_frac"] = self._pad_fraction(tokens, window.slots)
        values.update(self.guards.metrics())
        values.update(self._data_counts())
        values.update(gpu_memory.peaks(self.env))  # a collective on CUDA (every rank logs this step)
        self.metrics.log(self.state.step, values, epoch=self.state.epoch)
        log.debug("step %d %s", self.state.step, values)
        return values, ended

    def _pad_fraction(self, tokens: int, slots: int) -> float:
        """The share of the window's row places (all ranks) that held no trained token."""
        counts = torch.tensor([tokens, slots], dtype=torch.float64, device=self.env.device)
        with self.progress.section("all_reduce(data/pad_frac)", self.state.step):
            real, places = self.strategy.all_reduce(counts, op="sum").tolist()
        return 1.0 - real / max(places, 1.0)

    def _data_counts(self) -> dict[str, float]:
        """Per-source sample counts of a data set that keeps them (data=mix: `data/mix/<name>`)."""
        counts = getattr(self.train_loader.dataset, "consumed_counts", None)
        if counts is None or self.steps_per_epoch is None:  # a mixture is map-style: it has epochs
            return {}
        s = self.state
        return counts(
            self.train_loader.sampler, s.epoch, s.epoch_samples, self.steps_per_epoch * self.global_batch
        )

    def _summary(self, elapsed: float) -> dict[str, Any]:
        s = self.state
        return {
            "steps": s.step,
            "epochs": s.epoch + (1 if s.epoch_samples else 0),  # a partly trained epoch counts
            "samples": s.samples,
            "train_time_s": round(elapsed, 3),
            "samples_per_s": s.samples / max(elapsed, 1e-9),
            "first_step_at": s.first_step_at,
            "checkpoint_stall_s": [round(x, 4) for x in self.ckpt.stalls],
            **self.throughput.last,  # the last log window's FLOPs per step, TFLOP/s and MFU
            **self.guards.metrics(),
            **gpu_memory.peaks(self.env),  # every rank builds the summary: a collective on CUDA
            **host_memory.peaks(self.env),  # a collective: every rank
            **self._step_time_quantiles(),  # a collective: every rank
            **s.last_val,
            **self.monitoring.summary(),
        }

    def _step_time_quantiles(self) -> dict[str, list[float]]:
        """Each rank's step time (its data wait + its step, on the device's clock: StepClock) p50
        and p95 over the last `steptimes.KEPT` steps, gathered once at the end in one small
        all-reduce: `disttrain show` flags a rank much slower than the median (a straggler)."""
        world, rank = self.env.world_size, self.env.rank
        mine = torch.tensor(self.step_clock.seconds() or [0.0], dtype=torch.float64)
        table = torch.zeros(world, 2, dtype=torch.float64)
        table[rank] = torch.quantile(mine, torch.tensor([0.5, 0.95], dtype=torch.float64))
        if dist.is_initialized() and world > 1:
            table = table.to(self.env.device)
            dist.all_reduce(table)  # each rank fills its own row: the sum is the table
        rows = table.cpu().tolist()
        return {
            "step_time_p50_s_by_rank": [round(r[0], 6) for r in rows],
            "step_time_p95_s_by_rank": [round(r[1], 6) for r in rows],
        }


@torch.no_grad()
def validation(
    strategy: Strategy,
    model: nn.Module,
    task: Task,
    loader: DataLoader,
    device: torch.device,
    cap: int | None = None,
) -> dict[str, float]:
    """val/loss (and val/<metric>) of `model` over `loader`'s shards (at most `cap` batches each,
    trainer.val_batches: a stream's length), weighted by sample counts across ranks; {} when no
    rank has a sample. Every rank calls it (collectives): training's validation and `disttrain
    eval` share it."""
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss*n, metric numerator, n
    batch: Any = None
    done = 0
    for batch in itertools.islice(loader, cap):
        inputs, target = task.unpack(batches.to_device(batch, device))
        sums += strategy.eval_step(model, inputs, target, task)
        done += 1
    for _ in range(val_batches(loader, cap) - done):
        # A shorter shard: join the other ranks' collectives with a forward whose result is dropped.
        if batch is None:
            batch = default_collate(first_samples(loader.dataset, 1))
        inputs, target = task.unpack(batches.to_device(batch, device))
        strategy.eval_step(model, inputs, target, task)
    sums = strategy.all_reduce(sums, op="sum")
    count = sums[2].item()
    if count == 0:
        return {}
    values = {"val/loss": sums[0].item() / count}
    if task.metric:
        values[f"val/{task.metric}"] = sums[1].item() / count
    values.update(task.derived(values))
    return values


def val_batches(loader: DataLoader, cap: int | None = None) -> int:
    """Batches of the longest validation shard, at most `cap` (trainer.val_batches): every rank
    runs this many forwards. A stream runs `cap` (the pre-launch checks require it)."""
    if is_stream(loader.dataset):
        if cap is None:
            raise ValueError("a stream validation set needs trainer.val_batches")
        return cap
    longest = getattr(loader.sampler, "longest", None)
    n = len(loader) if longest is None or loader.batch_size is None else -(-longest // loader.batch_size)
    return n if cap is None else min(n, cap)


def split_batches(micro_batches: list[Any], parts: int) -> list[Any]:
    """Cut each micro-batch (any structure) into `parts` consecutive pieces (the last may be smaller)."""
    if parts == 1:
        return micro_batches
    return [piece for batch in micro_batches for piece in batches.split(batch, parts)]


def global_batch(trainer: TrainerConfig, dp_size: int) -> int:
    """Samples per optimizer step across the data-parallel replicas."""
    return trainer.batch_size * trainer.grad_accum * dp_size
