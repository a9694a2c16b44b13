"""Post-local SGD: plain DDP for `warmup_steps`, then local steps with parameters averaged every N.

PyTorch's pieces: `post_localSGD_hook` all-reduces gradients until `start_localSGD_iter` and then
stops (no intra-node subgroup, which would need GPUs to size it), and `PostLocalSGDOptimizer` with a
`PeriodicModelAverager` averages parameters after every `sync_every`-th optimizer step. Both are
wrapped to count the bytes they all-reduce, so the saving is measured, not assumed.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
    PostLocalSGDState,
    post_localSGD_hook,
)
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.distributed.algorithms.model_averaging.utils import average_parameters
from torch.distributed.optim import PostLocalSGDOptimizer
from torch.nn.parallel import DistributedDataParallel

from disttrain.config.schema import AmpConfig
from disttrain.dist import DistEnv
from disttrain.strategies.ddp import DDPStrategy
from disttrain.strategies.specs.data_parallel import LocalSGDStrategyConfig


class CountingAverager(PeriodicModelAverager):
    """PeriodicModelAverager that adds the bytes of each parameter average to `counter`."""

    def __init__(self, period: int, warmup_steps: int, counter: dict[str, int]) -> None:
        with warnings.catch_warnings():
            # period=1 "should just use DDP": true for speed, but it is the parity check of this path.
            warnings.filterwarnings("ignore", message="When period is 1")
            super().__init__(period=period, warmup_steps=warmup_steps)
        self.counter = counter
        self.averaged_last = False  # did the last optimizer step end with an average?

    def average_parameters(self, params: Any) -> None:
        due = self.step >= self.warmup_steps and (self.step - self.warmup_steps) % self.period == 0
        self.averaged_last = due
        if due:
            groups = list(params)
            tensors = [p for g in groups for p in (g["params"] if isinstance(g, dict) else [g])]
            self.counter["params"] += sum(p.numel() * p.element_size() for p in tensors)
            params = groups
        super().average_parameters(params)


class LocalSGDStrategy(DDPStrategy):
    cfg: LocalSGDStrategyConfig

    def __init__(self, cfg: LocalSGDStrategyConfig, env: DistEnv, amp: AmpConfig | None = None) -> None:
        super().__init__(cfg, env, amp)
        self.sync_every = cfg.sync_every
        self.warmup_steps = cfg.warmup_steps
        self.allreduced = {"grads": 0, "params": 0}
        self.steps = 0
        self.averager: CountingAverager | None = None
        self.grads_synced = True  # did the last backward all-reduce gradients (warm-up)?

    def setup_module(self, model: nn.Module) -> nn.Module:
        ddp = super().setup_module(model)  # comm_hook is rejected by the config check for localsgd
        assert isinstance(ddp, DistributedDataParallel)
        state = PostLocalSGDState(
            process_group=None,
            subgroup=None,
            start_localSGD_iter=self.warmup_steps,
            post_local_gradient_allreduce=False,
        )

        # No annotations: DDP inspects them and a postponed (string) `dist.GradBucket` fails its check.
        def counting_hook(st, bucket):
            self.grads_synced = st.iter < st.start_localSGD_iter  # before the hook counts this backward
            if self.grads_synced:
                self.allreduced["grads"] += bucket.buffer().numel() * bucket.buffer().element_size()
            return post_localSGD_hook(st, bucket)

        ddp.register_comm_hook(state, counting_hook)
        self.hook_state = state
        return ddp

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        averager = CountingAverager(self.sync_every, self.warmup_steps, self.allreduced)
        self.averager = averager
        return _CountingPostLocalSGD(optim=optimizer, averager=averager, strategy=self)

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
        """Each rank's OWN model and optimizer state, plus the phase counters.

        Between averages the replicas differ, but DCP treats a plain tensor under the same name on
        every rank as one replicated value and keeps a single copy (from any rank, tensor by tensor),
        which would mix replicas on resume. So rank 0 saves under the usual names (what `export`
        reads) and rank r > 0 under `rank<r>/`: an exact resume, on the same world size.
        """
        state = super().state_dict(model, _plain(optimizer))
        if self.env.rank > 0:
            state = {f"rank{self.env.rank}": state}
        if optimizer is not None:  # None: the model only (eval), no counters
            state["localsgd"] = torch.tensor([self.hook_state.iter, _averager(optimizer).step, self.steps])
        return state

    def load_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, state: dict[str, Any]
    ) -> None:
        own = state[f"rank{self.env.rank}"] if self.env.rank > 0 else state
        super().load_state_dict(model, _plain(optimizer), own)
        if optimizer is not None:
            self.hook_state.iter, _averager(optimizer).step, self.steps = (int(v) for v in state["localsgd"])

    def end_of_training(self, model: nn.Module) -> None:
        """Replicas drift apart between averages; the trained model is their average, so the final
        validation, checkpoint and final.pt see one model, not rank 0's replica."""
        # In sync: the last backward still all-reduced gradients (the hook's warm-up; not the
        # averager's count, since a skipped step runs backward but no optimizer step), or the last
        # optimizer step averaged (a skipped step after it changes no replica).
        if self.averager is None or self.grads_synced or self.averager.averaged_last:
            return
        params = list(model.parameters())
        average_parameters(iter(params), process_group=None)  # type: ignore[arg-type]
        self.allreduced["params"] += sum(p.numel() * p.element_size() for p in params)

    def summary_stats(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        stats = super().summary_stats(model, optimizer)
        total = sum(self.allreduced.values())
        stats["allreduce_bytes"] = dict(self.allreduced, total=total)
        stats["allreduce_bytes_per_step"] = total / max(self.steps, 1)
        return stats


class _CountingPostLocalSGD(PostLocalSGDOptimizer):
    """Counts optimizer steps for the bytes-per-step figure."""

    def __init__(
        self, optim: torch.optim.Optimizer, averager: CountingAverager, strategy: LocalSGDStrategy
    ) -> None:
        super().__init__(optim=optim, averager=averager)
        self._strategy = strategy

    def step(self) -> None:  # type: ignore[override]
        super().step()
        self._strategy.steps += 1


def _plain(optimizer: torch.optim.Optimizer | None) -> torch.optim.Optimizer | None:
    """The wrapped optimizer: DCP reads and writes its state (the averager's step is saved apart)."""
    if optimizer is None:
        return None
    assert isinstance(optimizer, PostLocalSGDOptimizer)
    return optimizer.optim


def _averager(optimizer: torch.optim.Optimizer) -> Any:
    assert isinstance(optimizer, PostLocalSGDOptimizer)
    return optimizer.averager
