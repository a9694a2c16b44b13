"""The training loop: accumulate, clip, step, validate, log, checkpoint — the same for every strategy."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from disttrain import checkpoint
from disttrain.dist import DistEnv
from disttrain.engine.tasks import Task
from disttrain.observe.metrics import NullMetrics
from disttrain.observe.progress import make_progress
from disttrain.strategies.base import Strategy

log = logging.getLogger("disttrain")


@dataclass
class LoopState:
    step: int = 0
    epoch: int = 0
    samples: int = 0
    last_val: dict[str, float] = field(default_factory=dict)
    first_step_at: float | None = None


@dataclass
class Window:
    """Train metrics gathered between two log steps; reduced across ranks only when logged."""

    loss_sum: torch.Tensor
    steps: int = 0
    started: float = field(default_factory=time.perf_counter)


class Engine:
    def __init__(
        self,
        trainer: dict[str, Any],
        env: DistEnv,
        strategy: Strategy,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        task: Task,
        train_loader: DataLoader,
        val_loader: DataLoader | None,
        metrics: NullMetrics,
        run_dir: Path,
    ) -> None:
        self.t, self.env, self.strategy = trainer, env, strategy
        self.model, self.optimizer, self.scheduler, self.task = model, optimizer, scheduler, task
        self.train_loader, self.val_loader, self.metrics, self.run_dir = (
            train_loader,
            val_loader,
            metrics,
            run_dir,
        )
        self.accum = int(trainer["grad_accum"])
        self.steps_per_epoch = len(train_loader) // self.accum
        if self.steps_per_epoch < 1:
            raise ValueError(
                f"{len(train_loader)} batches per epoch on this rank cannot fill one step of grad_accum={self.accum}"
            )
        self.total_steps = total_steps(trainer, len(train_loader))
        self.global_batch = int(trainer["batch_size"]) * self.accum * env.world_size
        self.state = LoopState()

    # ------------------------------------------------------------------------------------ fit
    def fit(self) -> dict[str, Any]:
        s, t = self.state, self.t
        started = time.perf_counter()
        window = self._new_window()
        with make_progress(self.env.is_zero and t["progress"], self.total_steps, "train") as bar:
            while s.step < self.total_steps:
                self._set_epoch(s.epoch)
                for micro_batches in self._groups():
                    loss, grad_norm = self.train_step(micro_batches)
                    s.step += 1
                    s.samples += self.global_batch
                    window.loss_sum += loss
                    window.steps += 1
                    if s.step % t["log_every"] == 0 or s.step == self.total_steps:
                        values = self._log_train(window, grad_norm)
                        window = self._new_window()
                        bar.update(s.step, loss=values["train/loss"], lr=values["lr"])
                    if t["val_every"] and s.step % t["val_every"] == 0:
                        self.validate()
                    if t["ckpt_every"] and s.step % t["ckpt_every"] == 0:
                        self.save(f"step_{s.step:08d}.pt")
                    if s.step >= self.total_steps:
                        break
                s.epoch += 1
                if not t["val_every"]:
                    self.validate()
        if t["val_every"] and s.step % t["val_every"] != 0:
            self.validate()
        self.save("final.pt")
        return self._summary(time.perf_counter() - started)

    # ------------------------------------------------------------------------------------ step
    def train_step(self, micro_batches: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over `grad_accum` micro-batches; all-reduce only on the last."""
        self.model.train()
        total = torch.zeros((), device=self.env.device)
        n = len(micro_batches)
        for i, (x, y) in enumerate(micro_batches):
            x, y = x.to(self.env.device, non_blocking=True), y.to(self.env.device, non_blocking=True)
            with self.strategy.no_backward_sync(self.model, enabled=i < n - 1):
                total += self.strategy.forward_backward(self.model, x, y, self.task.loss, scale=1.0 / n)
        grad_norm = self.strategy.clip_grad_norm(self.model, self.t["clip_grad_norm"])
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        if self.state.first_step_at is None:
            self.state.first_step_at = time.time()
        return total, grad_norm

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """Loss and metric over the whole validation set, weighted by sample counts across ranks."""
        if self.val_loader is None:
            return {}
        self.model.eval()
        sums = torch.zeros(3, dtype=torch.float64, device=self.env.device)  # loss*n, metric numerator, n
        for x, y in self.val_loader:
            x, y = x.to(self.env.device), y.to(self.env.device)
            sums += self.strategy.eval_step(self.model, x, y, self.task)
        sums = self.strategy.all_reduce(sums, op="sum")
        count = max(sums[2].item(), 1.0)
        values = {"val/loss": sums[0].item() / count, f"val/{self.task.metric}": sums[1].item() / count}
        self.state.last_val = values
        self.metrics.log(self.state.step, values, epoch=self.state.epoch)
        log.info("step %d val: %s", self.state.step, " ".join(f"{k}={v:.4f}" for k, v in values.items()))
        return values

    # ------------------------------------------------------------------------------------ helpers
    def _groups(self) -> Iterator[list[Any]]:
        batches = iter(self.train_loader)
        for _ in range(self.steps_per_epoch):
            yield [next(batches) for _ in range(self.accum)]

    def _set_epoch(self, epoch: int) -> None:
        set_epoch = getattr(self.train_loader.sampler, "set_epoch", None)
        if set_epoch is not None:
            set_epoch(epoch)

    def _new_window(self) -> Window:
        return Window(loss_sum=torch.zeros((), device=self.env.device))

    def _log_train(self, window: Window, grad_norm: torch.Tensor) -> dict[str, float]:
        elapsed = time.perf_counter() - window.started
        loss = self.strategy.all_reduce(window.loss_sum / window.steps, op="mean").item()
        values = {
            "train/loss": loss,
            "lr": self.optimizer.param_groups[0]["lr"],
            "grad_norm": float(grad_norm),
            "samples_per_s": window.steps * self.global_batch / max(elapsed, 1e-9),
            "step_time_s": elapsed / window.steps,
        }
        self.metrics.log(self.state.step, values, epoch=self.state.epoch)
        log.debug("step %d %s", self.state.step, values)
        return values

    def save(self, name: str) -> None:
        state = {
            "model": self.strategy.model_state_dict(self.model),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "step": self.state.step,
            "epoch": self.state.epoch,
        }
        if self.env.is_zero:
            checkpoint.save_atomic(state, self.run_dir / "checkpoints" / name)
        self.strategy.barrier()

    def _summary(self, elapsed: float) -> dict[str, Any]:
        s = self.state
        return {
            "steps": s.step,
            "epochs": s.epoch,
            "samples": s.samples,
            "train_time_s": round(elapsed, 3),
            "samples_per_s": s.samples / max(elapsed, 1e-9),
            "first_step_at": s.first_step_at,
            **s.last_val,
        }


def total_steps(trainer: dict[str, Any], batches_per_epoch: int) -> int:
    """Optimizer steps the run will take: max_steps, or max_epochs x full accumulation groups."""
    per_epoch = batches_per_epoch // int(trainer["grad_accum"])
    by_epochs = int(trainer["max_epochs"]) * per_epoch
    return int(trainer["max_steps"]) if trainer["max_steps"] > 0 else by_epochs
