"""TrainState: where training is (step, epoch, samples, position in the epoch, last validation).

`Stateful` (state_dict / load_state_dict) as torchtitan's TrainState: the checkpoint manager saves
it like any other state object, into meta.json (plain JSON that `runs`/`resume` read without torch).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TrainState:
    step: int = 0
    epoch: int = 0
    samples: int = 0
    epoch_samples: int = 0  # global samples of the current epoch's permutation already consumed
    last_val: dict[str, float] = field(default_factory=dict)
    lr: float = 0.0  # the lr the last optimizer step used (the scheduler has moved on since)
    first_step_at: float | None = None  # wall time of this process's first step (not saved)
    watch: dict[str, Any] = field(default_factory=dict)  # early stopping: best, its step, bad count
    best: list[list[Any]] = field(default_factory=list)  # keep_best: [value, step], best first

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "epoch": self.epoch,
            "epoch_samples": self.epoch_samples,
            "samples": self.samples,
            "last_val": dict(self.last_val),
            "watch": dict(self.watch),
            "best": [list(e) for e in self.best],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.epoch, self.samples = int(state["step"]), int(state["epoch"]), int(state["samples"])
        self.epoch_samples = int(state["epoch_samples"])
        self.last_val = dict(state.get("last_val") or {})
        self.watch = dict(state.get("watch") or {})  # checkpoints from before early stopping: none
        self.best = [list(e) for e in state.get("best") or []]
