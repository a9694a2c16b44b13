"""Step guards: non-finite loss or gradient norm (trainer.detect_anomaly) and AMP step skips.

`stop` fails the run before the optimizer touches the weights, naming the step, the ranks whose
loss was not finite and the last good checkpoint; `skip` drops the step (no update) and counts it.
One small all-reduce per step while enabled, so every rank takes the same decision.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from disttrain import checkpoint
from disttrain.config.schema import DebugConfig
from disttrain.dist import DistEnv
from disttrain.storage import ObjectPath
from disttrain.strategies.precision import Precision

log = logging.getLogger("disttrain")


class AnomalyError(FloatingPointError):
    """A non-finite loss or gradient norm with trainer.detect_anomaly=stop."""


class DesyncError(RuntimeError):
    """debug.check_sync_every found replicas whose parameters or buffers differ."""


class Guards:
    """Per-step checks, given what they look at: the ranks (env), the precision, the strategy and
    the model (for replica checksums and gradient norms), and where the last good checkpoint is."""

    def __init__(
        self,
        detect_anomaly: str,
        debug: DebugConfig,
        env: DistEnv,
        precision: Precision,
        strategy: Any,
        model: nn.Module,
        ckpt_dir: Path | ObjectPath | None = None,
    ) -> None:
        self.mode = detect_anomaly
        self.env, self.precision, self.strategy, self.model, self.ckpt_dir = (
            env,
            precision,
            strategy,
            model,
            ckpt_dir,
        )
        self.anomaly_skips = 0
        self.sync_every = debug.check_sync_every
        self.grad_stats = debug.log_grad_stats

    def after_backward(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        """True: skip the update of step `step`. Raises AnomalyError in `stop` mode."""
        if self.mode == "off":
            return False
        env = self.env
        flags = torch.zeros(env.world_size + 1, device=env.device)
        flags[env.rank] = float(not torch.isfinite(loss).item())
        # under fp16 an overflowing gradient is the scaler's business (it skips the step itself)
        if not self.precision.scaling and not math.isfinite(float(grad_norm)):
            flags[-1] = 1.0
        if dist.is_initialized() and env.world_size > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if not flags.any():
            return False
        ranks = [r for r in range(env.world_size) if flags[r] > 0]
        what = (
            f"non-finite loss on rank(s) {ranks}"
            if ranks
            else f"non-finite gradient norm ({float(grad_norm)}) on every rank"
        )
        if self.mode == "skip":
            self.anomaly_skips += 1
            log.warning("step %d: %s; step skipped (%d so far)", step, what, self.anomaly_skips)
            return True
        last = checkpoint.committed(self.ckpt_dir) if self.ckpt_dir is not None else []
        raise AnomalyError(
            f"trainer.detect_anomaly=stop: {what} at step {step} (this is rank {env.rank}); the "
            f"weights were not updated. Last good checkpoint: {last[-1] if last else 'none'}. HINT: "
            "lower optim.lr, set trainer.clip_grad_norm, try amp=bf16 instead of fp16, or "
            "trainer.detect_anomaly=skip to drop such steps."
        )

    def after_step(self, step: int) -> None:
        """After optimizer step `step`: every `check_sync_every` steps, compare the replicas."""
        if self.sync_every and step % self.sync_every == 0:
            self.check_sync(step)

    def check_sync(self, step: int) -> None:
        """All-gather one float64 checksum per parameter and buffer (`replicated_state`); fail
        naming the first that differs."""
        env = self.env
        if not (dist.is_initialized() and env.world_size > 1):
            return
        named = replicated_state(self.strategy.unwrap(self.model))
        mine = torch.stack([t.detach().double().sum() for _, t in named]).to(env.device)
        every = [torch.empty_like(mine) for _ in range(env.world_size)]
        dist.all_gather(every, mine)
        table = torch.stack(every)  # (world, tensors)
        differs = (table != table[0]).any(dim=0).nonzero().flatten()
        if len(differs):
            i = int(differs[0])
            ranks = [r for r in range(env.world_size) if table[r, i] != table[0, i]]
            kind = "parameter" if isinstance(named[i][1], nn.Parameter) else "buffer"
            raise DesyncError(
                f"debug.check_sync_every: {kind}s diverged across ranks at step {step}: first "
                f"diverged {kind} {named[i][0]!r} (checksum {table[0, i].item():.17g} on rank 0, "
                f"{', '.join(f'{table[r, i].item():.17g} on rank {r}' for r in ranks)}); ranks {ranks} "
                f"differ from rank 0 ({len(differs)} of {len(named)} parameters and buffers). HINT: look "
                "for rank-dependent code touching the weights or buffers, or a gradient that skipped "
                "the all-reduce."
            )

    def grad_norms(self) -> dict[str, float]:
        """grad_norm/NAME for every parameter with a gradient (global norms for DTensor shards)."""
        if not self.grad_stats:
            return {}
        from torch.distributed.tensor import DTensor

        out = {}
        for name, p in self.strategy.unwrap(self.model).named_parameters():
            if p.grad is None:
                continue
            norm = torch.linalg.vector_norm(p.grad.detach())
            norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
            out[f"grad_norm/{name}"] = float(norm)
        return out

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        p = self.precision
        if p.scaling:
            out["amp/scale"] = p.scale_value()
            out["amp/skipped_steps"] = float(p.skipped_steps)
        if self.mode == "skip":
            out["anomaly_skipped_steps"] = float(self.anomaly_skips)
        return out


def replicated_state(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """What every data-parallel replica must hold alike: each parameter, then each buffer except
    running statistics, the floating-point buffers of a module that tracks them (BatchNorm's mean
    and variance): each replica updates those from its own batches, and the strategy averages them
    before every validation and save (`Strategy.sync_buffers`). Their batch counter is compared:
    every replica runs the same forwards."""
    named: list[tuple[str, torch.Tensor]] = list(model.named_parameters())
    for prefix, module in model.named_modules():
        running = bool(getattr(module, "track_running_stats", False))
        for name, b in module.named_buffers(prefix=prefix, recurse=False):
            if not (running and b.is_floating_point()):
                named.append((name, b))
    return named
