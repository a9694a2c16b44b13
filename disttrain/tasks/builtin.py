"""The built-in tasks and `build_task` (imports torch); `disttrain.tasks` names them."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from disttrain.config.schema import TaskTarget
from disttrain.data.packing import IGNORE, is_packed
from disttrain.tasks.batch import describe, field, leading_size


class Task:
    """`criterion(model(batch[inputs]), batch[target])`; the base of every task.

    Override any method: `unpack` (batch -> inputs, target), `forward` (the model call), `loss`,
    `metric_sum` (the metric's numerator summed over the batch's samples), `count` and `tokens`.
    """

    metric: str | None = None  # reported as val/<metric>: metric_sum / samples, all ranks together
    perplexity: bool = False  # also report exp(loss) as */ppl

    def __init__(
        self, criterion: Callable[..., torch.Tensor] | None = None, inputs: str = "x", target: str = "y"
    ):
        self.criterion = criterion if criterion is not None else self.default_criterion()
        self.inputs, self.target = inputs, target

    def default_criterion(self) -> Callable[..., torch.Tensor] | None:
        """The criterion when none is configured (the built-in tasks' nn.*Loss; the base: none)."""
        return None

    def setup(self, device: torch.device) -> Task:
        """Move the criterion's buffers (e.g. class weights) to the run's device."""
        if isinstance(self.criterion, nn.Module):
            self.criterion.to(device)
        return self

    # ------------------------------------------------------------------------------ the step
    def unpack(self, batch: Any) -> tuple[Any, Any]:
        """(inputs, target) of a batch: the fields `task.inputs` and `task.target` (x, y)."""
        if isinstance(batch, (tuple, list)) and len(batch) != 2 and (self.inputs, self.target) == ("x", "y"):
            raise ValueError(
                f"the batch is {describe(batch)}: {type(self).__name__} reads x (item 0) as inputs and "
                f"y (item 1) as target, and would silently ignore the rest"
            )
        return field(batch, self.inputs), field(batch, self.target)

    def forward(self, model: nn.Module, inputs: Any, target: Any) -> Any:
        """The model call: model(**inputs) for a dict, model(*inputs) for a tuple, else model(inputs)."""
        return call_model(model, inputs)

    def loss(self, output: Any, target: Any) -> torch.Tensor:
        if self.criterion is None:
            raise TypeError(f"{type(self).__name__} has no criterion: set task.criterion._target_")
        return self.criterion(output, target)

    def metric_sum(self, output: Any, target: Any) -> torch.Tensor | None:
        """The metric's numerator summed over the batch (divided by all samples later); None: none."""
        return None

    def count(self, inputs: Any, target: Any) -> int:
        """Samples in the batch (validation weights and throughput): the target's first dimension."""
        return leading_size(target) or leading_size(inputs)

    def tokens(self, inputs: Any, target: Any) -> int | torch.Tensor:
        """Real tokens in the batch, for tokens/s (0: not a sequence task); a tensor where counting
        them reads the batch (packed rows: the device is not waited for until the log step)."""
        return 0

    def slots(self, inputs: Any, target: Any) -> int:
        """Places in the batch's rows, padding included (0: no padding to report): with `tokens`,
        data/pad_frac and the FLOPs the device did."""
        return 0

    def derived(self, values: dict[str, float]) -> dict[str, float]:
        """Metrics computed from the all-reduced ones (perplexity from the mean loss)."""
        if not self.perplexity:
            return {}
        return {
            k.replace("loss", "ppl"): math.exp(min(values[k], 50.0))
            for k in ("val/loss", "train/loss")
            if k in values
        }

    # ------------------------------------------------------------------------------ composed
    def eval_sums(self, output: Any, inputs: Any, target: Any) -> torch.Tensor:
        """[loss x n, metric numerator, n] in float64: summed over ranks, then divided by n."""
        loss = self.loss(output, target)
        n = self.count(inputs, target)
        metric = self.metric_sum(output, target)
        zero = torch.zeros((), dtype=torch.float64, device=loss.device)
        return torch.stack(
            [
                loss.detach().to(torch.float64) * n,
                zero if metric is None else metric.to(torch.float64),
                zero + float(n),
            ]
        )

    @property
    def plain_forward(self) -> bool:
        """Whether the model is called as model(inputs) (what a pipeline of stages can run)."""
        return type(self).forward is Task.forward


class Classification(Task):
    """Cross-entropy (or your criterion) on class logits; the metric is accuracy."""

    metric = "acc"

    def default_criterion(self) -> Callable[..., torch.Tensor] | None:
        return nn.CrossEntropyLoss()

    def metric_sum(self, output: Any, target: Any) -> torch.Tensor | None:
        return (output.argmax(dim=-1) == target).sum().to(torch.float64)


class Regression(Task):
    """Mean squared error (or your criterion); the reported metric is the MSE itself."""

    metric = "mse"

    def default_criterion(self) -> Callable[..., torch.Tensor] | None:
        return nn.MSELoss()

    def metric_sum(self, output: Any, target: Any) -> torch.Tensor | None:
        per_sample = F.mse_loss(output, target, reduction="none").reshape(len(target), -1).mean(dim=1)
        return per_sample.sum().to(torch.float64)


class LanguageModel(Task):
    """Cross-entropy per token over (batch, time, vocab) logits; the metric is next-token accuracy
    (per sample: the mean over its tokens); perplexity = exp(mean loss).

    Packed rows (data.packing=true: a dict batch of input_ids, labels, position_ids, with the
    default fields x and y) are read as such: the model is called as
    `model(input_ids=..., position_ids=...)`, the target is the labels shifted by one, and the
    IGNORE (-100) targets (padding, document starts, prompts) count in no loss, metric or token."""

    metric = "acc"
    perplexity = True

    def default_criterion(self) -> Callable[..., torch.Tensor] | None:
        return nn.CrossEntropyLoss()

    def unpack(self, batch: Any) -> tuple[Any, Any]:
        if (self.inputs, self.target) == ("x", "y") and is_packed(batch):
            target = F.pad(batch["labels"][..., 1:], (0, 1), value=IGNORE)
            return {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}, target
        return super().unpack(batch)

    def loss(self, output: Any, target: Any) -> torch.Tensor:
        output = getattr(output, "logits", output)
        return super().loss(output.flatten(0, -2).float(), target.flatten())

    def metric_sum(self, output: Any, target: Any) -> torch.Tensor | None:
        output = getattr(output, "logits", output)
        real = (target != IGNORE).reshape(len(target), -1)
        hits = (output.argmax(dim=-1) == target).reshape(len(target), -1) & real
        return (hits.sum(dim=1).to(torch.float64) / real.sum(dim=1).clamp(min=1)).sum()

    def tokens(self, inputs: Any, target: Any) -> int | torch.Tensor:
        if isinstance(inputs, Mapping) and "position_ids" in inputs:
            return (target != IGNORE).sum()
        return int(target.numel())

    def slots(self, inputs: Any, target: Any) -> int:
        return int(target.numel()) if isinstance(inputs, Mapping) and "position_ids" in inputs else 0


class ModelLoss(Task):
    """The model computes its own loss: `model(**{arg: batch[field] for arg, field in call})`.

    `call` maps the model's arguments to batch fields (`{idx: x, targets: y}` for nanoGPT). Hugging
    Face causal LMs shift `labels` themselves: give them the *unshifted* ids (`{input_ids: x,
    labels: x}`); mapping labels to the already shifted `y` would train two tokens ahead. Without
    `call` the whole batch is passed (a dict as keyword arguments, a tuple as positional ones).

    The loss is found in the output as a 0-dim tensor, `.loss`, `["loss"]`, or the single 0-dim
    tensor in a tuple; `loss` (an attribute, key or index) names it for anything else. Packed rows
    (input_ids, labels, position_ids) count their labels other than -100 as tokens.
    """

    def __init__(
        self,
        call: Mapping[str, str] | None = None,
        loss: str | int | None = None,
        tokens: str | None = None,
        perplexity: bool = False,
    ):
        super().__init__(None)
        self.call = dict(call) if call else None
        self.loss_at = loss
        self.tokens_arg = tokens
        self.perplexity = perplexity

    def unpack(self, batch: Any) -> tuple[Any, Any]:
        if self.call is None:
            return batch, None
        return {arg: field(batch, name) for arg, name in self.call.items()}, None

    def loss(self, output: Any, target: Any) -> torch.Tensor:
        return find_loss(output, self.loss_at)

    def count(self, inputs: Any, target: Any) -> int:
        return leading_size(inputs)

    def tokens(self, inputs: Any, target: Any) -> int | torch.Tensor:
        if self.tokens_arg is None:
            return (inputs["labels"] != IGNORE).sum() if is_packed(inputs) else 0
        return int(field(inputs, self.tokens_arg).numel())

    def slots(self, inputs: Any, target: Any) -> int:
        return int(inputs["labels"].numel()) if self.tokens_arg is None and is_packed(inputs) else 0


class StepFunction(Task):
    """Your function as the whole step: `fn(model, batch) -> loss` or `(loss, samples)`."""

    def __init__(self, fn: Callable[..., Any]):
        super().__init__(None)
        self.fn = fn
        plain = getattr(fn, "func", fn)  # Hydra's partial (task.temperature=...) wraps the function
        self.name = (
            f"{getattr(plain, '__module__', '?')}.{getattr(plain, '__qualname__', type(plain).__name__)}"
        )

    def unpack(self, batch: Any) -> tuple[Any, Any]:
        return batch, None

    def forward(self, model: nn.Module, inputs: Any, target: Any) -> Any:
        return self.fn(model, inputs)

    def loss(self, output: Any, target: Any) -> torch.Tensor:
        loss = output[0] if isinstance(output, tuple) else output
        if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
            raise TypeError(
                f"task {self.name} returned {describe(output)}: it must return a 0-dim loss tensor "
                "or (loss, samples)"
            )
        return loss

    def eval_sums(self, output: Any, inputs: Any, target: Any) -> torch.Tensor:
        loss = self.loss(output, target)
        n = int(output[1]) if isinstance(output, tuple) and len(output) > 1 else leading_size(inputs)
        zero = torch.zeros((), dtype=torch.float64, device=loss.device)
        return torch.stack([loss.detach().to(torch.float64) * n, zero, zero + float(n)])


def call_model(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, Mapping):
        if "position_ids" in inputs and "use_cache" in forward_parameters(model):
            # packed rows: transformers reads documents from position_ids only without a KV cache
            # (masking_utils: "and cache is None"), which use_cache would make even in training
            return model(**inputs, use_cache=False)
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def forward_parameters(model: nn.Module) -> set[str]:
    """The argument names of the model's own forward, through DDP's `.module` and torch.compile's
    `._orig_mod` wrappers (which take *args, **kwargs)."""
    while isinstance(getattr(model, "module", None), nn.Module) or isinstance(
        getattr(model, "_orig_mod", None), nn.Module
    ):
        inner: nn.Module = getattr(model, "_orig_mod", None) or model.module  # type: ignore[assignment]
        model = inner
    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()


def find_loss(output: Any, at: str | int | None = None) -> torch.Tensor:
    """The 0-dim loss tensor in a model's output (see ModelLoss); TypeError names what is there."""
    found: Any = None
    if at is not None:
        if isinstance(at, int) or (isinstance(at, str) and at.lstrip("-").isdigit()):
            found = output[int(at)]
        elif isinstance(output, Mapping):
            found = output.get(at)
        else:
            found = getattr(output, at, None)
    elif isinstance(output, torch.Tensor):
        found = output
    elif isinstance(getattr(output, "loss", None), torch.Tensor):
        found = output.loss
    elif isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
        found = output["loss"]
    elif isinstance(output, (tuple, list)):
        scalars = [v for v in output if isinstance(v, torch.Tensor) and v.dim() == 0]
        found = scalars[0] if len(scalars) == 1 else None
    if isinstance(found, torch.Tensor) and found.dim() == 0:
        return found
    fields = list(output.keys()) if isinstance(output, Mapping) else None
    if fields is None and hasattr(output, "__dict__") and not isinstance(output, torch.Tensor):
        fields = [k for k in vars(output) if not k.startswith("_")]
    where = f"task.loss={at!r} names {describe(found)}" if at is not None else "no 0-dim loss tensor in it"
    raise TypeError(
        f"the model returned {type(output).__name__} {describe(output)}"
        + (f" with fields {fields}" if fields else "")
        + f": {where}. The loss is looked up as a 0-dim tensor, .loss, ['loss'] or the single 0-dim "
        "tensor of a tuple; set task.loss to its attribute, key or index"
    )


def build_task(node: TaskTarget | Mapping[str, Any] | None) -> Task:
    """The run's task from the `task` node; a plain function target becomes a StepFunction."""
    from disttrain.config.instantiate import build, locate

    spec = TaskTarget.of(node)
    target = locate(spec.target, "task._target_")
    if inspect.isfunction(target):
        return StepFunction(build({"_target_": spec.target, **spec.kwargs, "_partial_": True}, "task"))
    task = build({"_target_": spec.target, **spec.kwargs}, "task")
    if not isinstance(task, Task):
        from disttrain.config.errors import ConfigError

        raise ConfigError(
            "task._target_",
            spec.target,
            "a subclass of disttrain.tasks.Task, or a function step(model, batch) -> loss",
            "subclass Task and override what differs (unpack, forward, loss, metric_sum, count).",
        )
    return task
