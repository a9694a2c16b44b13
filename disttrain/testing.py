"""Fault injection for tests and scripts/kill_trials.py: an MLP that is slow, hangs or raises.

    disttrain train model._target_=disttrain.testing.FaultMLP +model.delay=0.02 +model.hang_at=5

Counts training forwards in this process (a restarted or resumed rank counts from 0 again).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from disttrain.models.mlp import MLP


class FaultMLP(MLP):
    def __init__(
        self,
        *args: Any,
        delay: float = 0.0,
        hang_at: int = 0,
        hang_rank: int = 1,
        raise_at: int = 0,
        **kwargs: Any,
    ) -> None:
        """delay: seconds of sleep per training forward; hang_at: forward number at which rank
        `hang_rank` sleeps for an hour; raise_at: forward number at which every rank raises."""
        super().__init__(*args, **kwargs)
        self.delay, self.hang_at, self.hang_rank, self.raise_at = delay, hang_at, hang_rank, raise_at
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            if self.delay:
                time.sleep(self.delay)
            if self.calls == self.hang_at and int(os.environ.get("RANK", 0)) == self.hang_rank:
                time.sleep(3600)
            if self.calls == self.raise_at:
                raise FloatingPointError(f"injected failure at training forward {self.calls}")
        return super().forward(x)
