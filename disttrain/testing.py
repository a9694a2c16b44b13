"""Fault injection for tests and scripts/kill_trials.py: an MLP that is slow, hangs or raises.

    disttrain train data=synthetic model._target_=disttrain.testing.FaultMLP \
        'model.in_features=${data.num_features}' 'model.num_classes=${data.num_classes}' \
        +model.delay=0.02 +model.hang_at=5

(tests: `*FAULT_MLP` for the first three overrides).

Counts training forwards in this process (a restarted or resumed rank counts from 0 again).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from disttrain.models.mlp import MLP

# The overrides that make FaultMLP the model: a swapped `_target_` starts from a clean node (it
# inherits no mlp keys), so the MLP arguments FaultMLP forwards are wired to the data here.
FAULT_MLP = (
    "model._target_=disttrain.testing.FaultMLP",
    "model.in_features=${data.num_features}",
    "model.num_classes=${data.num_classes}",
)

# The checkpoint writer's test hook (disttrain/checkpoint/writing.py `_test_pause`): seconds rank 0
# sleeps inside each save, after the shards and before the commit marker.
SAVE_SLEEP = "DISTTRAIN_TEST_SAVE_SLEEP"


class FaultMLP(MLP):
    def __init__(
        self,
        *args: Any,
        delay: float = 0.0,
        hang_at: int = 0,
        hang_rank: int = 1,
        raise_at: int = 0,
        nan_at: int = 0,
        nan_rank: int = 1,
        inf_grad_at: int = 0,
        oom_above: int = 0,
        oom_in: str = "forward",
        oom_rank: int = -1,
        perturb_at: int = 0,
        perturb_rank: int = 1,
        pause_at: int = 0,
        pause_file: str = "",
        hold_saves_from: int = 0,
        **kwargs: Any,
    ) -> None:
        """delay: seconds of sleep per training forward; hang_at: forward number at which rank
        `hang_rank` sleeps for an hour; raise_at: forward number at which every rank raises;
        nan_at: forward number from which rank `nan_rank` outputs NaN; inf_grad_at: forward number
        whose backward sends an infinite gradient (an fp16 overflow) on every rank; oom_above: a
        training batch larger than this raises torch.OutOfMemoryError, at the start of forward or
        (oom_in=backward) inside backward, after the gradient of the output layer exists, as a real
        CUDA OOM can (DDP's reducer is then mid-reduction), on every rank or only on rank `oom_rank`;
        perturb_at: forward number at
        which rank `perturb_rank` nudges its first parameter (a desync for debug.check_sync_every);
        pause_at: forward number at which every rank waits until the file `pause_file` exists (a
        test acts on a run held at a known step, then releases it: an event, not a race against
        the run's speed on a loaded machine); hold_saves_from: forward number from which rank 0's
        checkpoint saves hold for an hour inside their write, once every shard and rng file is
        written and before the commit marker, and log that they do (the checkpoint writer's
        DISTTRAIN_TEST_SAVE_SLEEP hook): a test SIGKILLs the run in the middle of a save on that
        log line, an event, after the saves before it committed."""
        super().__init__(*args, **kwargs)
        self.delay, self.hang_at, self.hang_rank, self.raise_at = delay, hang_at, hang_rank, raise_at
        self.nan_at, self.nan_rank, self.inf_grad_at = nan_at, nan_rank, inf_grad_at
        self.oom_above, self.perturb_at, self.perturb_rank = oom_above, perturb_at, perturb_rank
        if oom_in not in ("forward", "backward"):
            raise ValueError(f"oom_in={oom_in!r}: forward or backward")
        self.oom_in, self.oom_rank = oom_in, oom_rank
        if pause_at and not pause_file:
            raise ValueError("pause_at needs pause_file: the file whose creation releases the ranks")
        self.pause_at, self.pause_file = pause_at, pause_file
        self.hold_saves_from = hold_saves_from
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Faults fire in training ranks only, not in the parent's pre-launch dry step (no group yet).
        active = self.training and torch.distributed.is_initialized()
        if active:
            self.calls += 1
            if self.delay:
                time.sleep(self.delay)
            if self.calls == self.hang_at and _rank() == self.hang_rank:
                time.sleep(3600)
            if self.calls == self.pause_at:
                _wait_for_file(self.pause_file)
            if self.calls == self.hold_saves_from:
                os.environ[SAVE_SLEEP] = "3600"  # read by each save as it is about to commit
            if self.calls == self.raise_at:
                raise FloatingPointError(f"injected failure at training forward {self.calls}")
        oom = active and self.oom_above and len(x) > self.oom_above and self.oom_rank in (-1, _rank())
        if oom and self.oom_in == "forward":
            raise torch.OutOfMemoryError(f"injected: batch {len(x)} > {self.oom_above}")
        if active and self.calls == self.perturb_at and _rank() == self.perturb_rank:
            with torch.no_grad():
                next(self.parameters()).add_(1e-3)
        if oom and self.oom_in == "backward":
            # Before the output layer: its gradient exists (under DDP its bucket may be reducing)
            # when backward runs out of memory.
            hidden = _OOMInBackward.apply(self.layers[:-1](x), len(x), self.oom_above)
            out = self.layers[-1](hidden)
        else:
            out = super().forward(x)
        if active and self.nan_at and self.calls >= self.nan_at and _rank() == self.nan_rank:
            out = out * float("nan")
        if active and self.calls == self.inf_grad_at:
            out = _InfGrad.apply(out)
        return out


def _wait_for_file(path: str, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout:.0f} s")
        time.sleep(0.02)


def _rank() -> int:
    return int(os.environ.get("RANK", 0))


class _InfGrad(torch.autograd.Function):
    """Identity forward; backward sends an infinite gradient (what an fp16 overflow looks like)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("inf")


class _OOMInBackward(torch.autograd.Function):
    """Identity forward; backward raises torch.OutOfMemoryError (what a real CUDA OOM in backward does)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, size: int, limit: int) -> torch.Tensor:
        ctx.size, ctx.limit = size, limit
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:
        raise torch.OutOfMemoryError(f"injected in backward: batch {ctx.size} > {ctx.limit}")
