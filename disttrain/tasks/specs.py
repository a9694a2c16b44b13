"""The built-in tasks' specs and typed configs (torch-free): `task=classification|regression|lm|
model_loss`.

Each config extends the schema's `TaskConfig` and is stored in Hydra's ConfigStore as
`task/base_<name>`; a YAML under `configs/task/` fills values (`defaults: [base_<name>@task]`). A task
of yours is one module (a `Task` subclass, its config, its `TargetSpec` registered in `TASKS`),
declared in the `disttrain.tasks` entry-point group, plus one `task/<name>.yaml`; its spec's
`check_static(cfg, typed)` runs with the other pre-launch checks when the run's `task._target_` is
its target. (`task._target_=mylab.MyTask` alone needs no spec.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from disttrain.config.common import help_field as _h
from disttrain.config.registry import Registry, TargetSpec, target_registry
from disttrain.config.schema import TaskConfig

TASKS: Registry[TargetSpec] = target_registry(
    "tasks",
    key="task",
    module="disttrain.tasks.specs",
    hint="choose a task group option (task=lm), or your own: task._target_=mylab.MyTask.",
)


@dataclass
class CriterionTaskConfig(TaskConfig):
    criterion: Any = _h(
        "loss = criterion(model(inputs), target): any torch.nn loss or yours, by _target_", None
    )
    inputs: str = _h("batch field the model gets: x (item 0 of a tuple), an index, or a dict key", "x")
    target: str = _h(
        "batch field the loss compares with: y (item 1 of a tuple), an index, or a dict key", "y"
    )


def _criterion(target: str) -> Any:
    return field(default_factory=lambda: {"_target_": target}, metadata={"help": "the loss, by _target_"})


@dataclass
class ClassificationTaskConfig(CriterionTaskConfig):
    _target_: str = "disttrain.tasks.Classification"
    criterion: Any = _criterion("torch.nn.CrossEntropyLoss")


@dataclass
class RegressionTaskConfig(CriterionTaskConfig):
    _target_: str = "disttrain.tasks.Regression"
    criterion: Any = _criterion("torch.nn.MSELoss")


@dataclass
class LMTaskConfig(CriterionTaskConfig):
    _target_: str = "disttrain.tasks.LanguageModel"
    criterion: Any = _criterion("torch.nn.CrossEntropyLoss")


@dataclass
class ModelLossTaskConfig(TaskConfig):
    _target_: str = "disttrain.tasks.ModelLoss"
    call: Any = _h(
        "model arguments -> batch fields, e.g. {idx: x, targets: y}; null: the whole batch "
        "(a dict as keyword arguments)",
        None,
    )
    loss: Any = _h("where the loss is when not a 0-dim tensor, .loss, ['loss'] or a tuple's one scalar", None)
    tokens: str | None = _h("a model argument whose elements count as tokens (tokens/s), e.g. idx", None)
    perplexity: bool = _h("also report */ppl = exp(loss)", False)


CLASSIFICATION = TASKS.register(
    TargetSpec(
        "classification", ClassificationTaskConfig, ClassificationTaskConfig._target_, "class logits, val/acc"
    )
)
REGRESSION = TASKS.register(
    TargetSpec("regression", RegressionTaskConfig, RegressionTaskConfig._target_, "float targets, MSE")
)
LM = TASKS.register(TargetSpec("lm", LMTaskConfig, LMTaskConfig._target_, "next-token prediction, val/ppl"))
MODEL_LOSS = TASKS.register(
    TargetSpec("model_loss", ModelLossTaskConfig, ModelLossTaskConfig._target_, "the model computes its loss")
)
