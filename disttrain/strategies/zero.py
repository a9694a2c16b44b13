"""ZeRO-1: DDP for gradients, optimizer state partitioned across ranks (ZeroRedundancyOptimizer).

Each rank steps only the parameters it owns, then broadcasts them; ZeRO partitions whole tensors
(greedy by size), so a rank's share is about 1/world of the state, give or take one tensor.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from disttrain.strategies.ddp import DDPStrategy
from disttrain.strategies.specs.data_parallel import ZeroStrategyConfig


class ZeroStrategy(DDPStrategy):
    cfg: ZeroStrategyConfig

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        # Rebuild the configured optimizer as ZeRO's local one, with the same groups and hyperparameters.
        # Only the keyword arguments its constructor takes: `defaults` also holds derived keys.
        accepted = inspect.signature(type(optimizer).__init__).parameters
        kwargs = {k: v for k, v in optimizer.defaults.items() if k in accepted and k != "params"}
        groups = [
            {k: v for k, v in g.items() if k == "params" or k in accepted} for g in optimizer.param_groups
        ]
        return ZeroRedundancyOptimizer(
            groups,
            optimizer_class=type(optimizer),
            parameters_as_bucket_view=self.cfg.parameters_as_bucket_view,
            **kwargs,
        )

    def optimizer_states(self, optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
        inner = _inner(optimizer)
        assert inner is not None
        return list(inner.state.values())  # only this rank's partition

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
        """Each rank contributes the optimizer state of the parameters it owns, keyed by name.

        ZeRO's own state_dict() would first gather everything on one rank; going through the inner
        (local) optimizer instead lets DCP write each parameter's state once, from its owner, and
        load it back on whichever rank owns that parameter then.
        """
        return super().state_dict(model, _inner(optimizer))

    def load_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, state: dict[str, Any]
    ) -> None:
        super().load_state_dict(model, _inner(optimizer), state)


def _inner(optimizer: torch.optim.Optimizer | None) -> torch.optim.Optimizer | None:
    """ZeRO's local optimizer (None: the model only, see Strategy.state_dict)."""
    if optimizer is None:
        return None
    assert isinstance(optimizer, ZeroRedundancyOptimizer)
    return optimizer.optim
