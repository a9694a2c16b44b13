"""Tasks: the step from a batch to a loss and metrics (`loss = criterion(model(x), y)` and beyond).

A task owns everything between the data loader and the optimizer: it unpacks the batch, calls the
model, computes the loss, the metric numerator and the sample and token counts. The engine and the
strategies only call these methods, so any batch structure, model signature or loss plugs in by
`task._target_` (see docs in the README, "Bring your own model"):

- `classification`, `regression`, `lm`: `criterion(model(x), y)` with any criterion (`nn.*Loss` or
  your own module) through `task.criterion._target_`;
- `model_loss`: the model computes its own loss (`model(idx=x, targets=y)` -> `(logits, loss)`,
  Hugging Face `model(input_ids=x, labels=x).loss`);
- your own subclass of `Task` (contrastive pairs, per-sample weights, several inputs), or a function
  `step(model, batch) -> loss | (loss, samples)`.

`disttrain.tasks` itself is torch-free: the task specs (`disttrain.tasks.specs`, what config and
`--help` read) import without torch, and the classes below load from `disttrain.tasks.builtin` at
their first use (`disttrain.tasks.Classification` as a `_target_`, `from disttrain.tasks import Task`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from disttrain.tasks.builtin import (
        Classification,
        LanguageModel,
        ModelLoss,
        Regression,
        StepFunction,
        Task,
        build_task,
        call_model,
        find_loss,
    )

__all__ = [
    "Classification",
    "LanguageModel",
    "ModelLoss",
    "Regression",
    "StepFunction",
    "Task",
    "build_task",
    "call_model",
    "find_loss",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from disttrain.tasks import builtin

        return getattr(builtin, name)
    raise AttributeError(f"module 'disttrain.tasks' has no attribute {name!r}")
