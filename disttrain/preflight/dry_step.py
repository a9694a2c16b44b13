"""The pre-launch dry step: the task run on two real training samples before any rank starts.

Shape mismatches between data and model, labels out of range, a batch the task cannot unpack, an
output without a loss, a validation set shaped unlike the training set: each becomes one paragraph
naming the key to change, in seconds, instead of tracebacks from every rank after launch. A small
model (up to CPU_FIRST_MAX_PARAMS) runs on the CPU: building it costs less than the meta device's
first forward, which imports sympy and torch's decompositions (~0.5 s). A larger one runs on the
meta device (no memory, no compute); one that cannot (`.item()` inside forward, as Hugging Face
models do) runs once more on the CPU, where the error, if any, is the real one.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils.data import default_collate

from disttrain.config.errors import ConfigError
from disttrain.data.streams import first_samples
from disttrain.preflight import packing
from disttrain.tasks import Classification, LanguageModel, Regression, Task
from disttrain.tasks.batch import describe, to_device

if TYPE_CHECKING:
    from disttrain.config.run import Run

log = logging.getLogger("disttrain")

CPU_FALLBACK_MAX_PARAMS = 1_000_000_000  # beyond this the CPU re-run costs too much: warn instead
CPU_FIRST_MAX_PARAMS = 5_000_000  # up to this the dry step builds the model on the CPU (~20 MB)

SHAPE_HINT = (
    "Make the data and the model agree: the model's input width (e.g. model.in_features, by default "
    "${data.num_features}), or reshape the inputs in YAML with torch.nn.Sequential and "
    "torch.nn.Unflatten as the first module; if the model takes other arguments, use task=model_loss "
    "'task.call={arg: x}' or your own task (README: Bring your own model)"
)


def dry_step(
    run: Run,
    build_task: Callable[[], Task],
    meta_model: nn.Module | None,
    build_cpu_model: Callable[[], nn.Module] | None,
    train: Any,
    val: Any | None,
) -> None:
    """Raise ConfigError when the configured task cannot run one step on the data and model.

    `meta_model` None: the model's structure is unknown before launch (its factory refuses the meta
    device): only the data and the task are checked. `build_cpu_model` None: a CPU build would load
    the model's weights in the parent: the model runs on the meta device only, and a failure there
    is logged, not raised (it may be the meta device's, not the config's)."""
    samples = _samples(train, "data.train")
    batch = _collate(samples, "data.train")
    if val is not None and (val_samples := _samples(val, "data.val")):
        _same_structure(samples[0], val_samples[0])
    task = build_task()
    try:
        inputs, target = task.unpack(batch)
    except Exception as exc:
        raise ConfigError(
            "task",
            _target(run),
            f"a task that can unpack the data set's batches: {describe(batch)}",
            f"{_said(exc)}. Name the fields (task.inputs=..., task.target=... for dict keys or tuple "
            "indices), use task=model_loss 'task.call={argument: field}', or your own task's unpack().",
        ) from None
    _check_pipeline(run, task, inputs, target)
    _check_targets(run, task, train, target)
    if meta_model is None:
        return
    packing.check_model(run, meta_model, batch)
    params = sum(p.numel() for p in meta_model.parameters())
    name = _target(run)
    if params <= CPU_FIRST_MAX_PARAMS and build_cpu_model is not None:
        cpu_model = build_cpu_model()
        cpu_first = _run(name, task.setup(torch.device("cpu")), cpu_model, batch, torch.device("cpu"))
        if cpu_first is not None:
            raise cpu_first
        packing.check_documents(run, cpu_model, batch)
        return
    meta_exc = _run(name, task.setup(torch.device("meta")), meta_model, batch, torch.device("meta"))
    if meta_exc is None:
        return
    if build_cpu_model is None:
        log.warning(
            "dry step skipped: %s cannot run on the meta device (%s), and a CPU run would load the "
            "model's weights in the launcher",
            _target(run),
            _said(meta_exc),
        )
        return
    if params > CPU_FALLBACK_MAX_PARAMS:
        log.warning(
            "dry step skipped: %s cannot run on the meta device (%s), and a CPU run of %.2g parameters "
            "is too costly before launch",
            _target(run),
            _said(meta_exc),
            params,
        )
        return
    log.debug("dry step: %s on meta failed (%s); running it on the CPU", _target(run), _said(meta_exc))
    cpu_model = build_cpu_model()
    cpu_exc = _run(name, build_task(), cpu_model, batch, torch.device("cpu"))
    if cpu_exc is not None:
        raise cpu_exc
    packing.check_documents(run, cpu_model, batch)


def _run(
    name: str, task: Task, model: nn.Module, batch: Any, device: torch.device
) -> ConfigError | Exception | None:
    """One forward and loss (and metric) on `device`; the first failure as a ConfigError naming the
    task `name` (its `_target_`) or, when the model itself raised on the data's inputs, the model."""
    inputs, target = task.unpack(to_device(batch, device))
    calls = _ModelCalls(model)
    try:
        with torch.no_grad(), calls:
            output = task.forward(model, inputs, target)
    except torch.OutOfMemoryError as exc:  # memory is the device's business (trainer.oom), not the config's
        log.warning("dry step skipped: %s", _said(exc))
        return None
    except Exception as exc:
        return _forward_error(name, task, model, inputs, calls, exc)
    try:
        with torch.no_grad():
            loss = task.loss(output, target)
            task.eval_sums(output, inputs, target)
    except Exception as exc:
        return ConfigError(
            "task",
            name,
            f"a loss computable from the model's output {describe(output)} and the target {describe(target)}",
            f"its loss or metric raised {_said(exc)}{_where(exc)}. Check the output width against the "
            "targets (data.num_classes), task.criterion, or task.loss for where a model-computed loss is",
        )
    if not (isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.is_floating_point()):
        return ConfigError(
            "task",
            name,
            "a loss that is a 0-dim floating-point tensor",
            f"the loss is {describe(loss)}; reduce it (mean) in the criterion or the task",
        )
    return None


class _ModelCalls:
    """Whether an exception raised in the task's forward came out of the model's own forward, and
    what the model was given: a pre-hook and a hook on the model's top module count the calls that
    entered and those that returned."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.open = model, 0
        self.given: Any = None
        self.handles: list[Any] = []

    def __enter__(self) -> _ModelCalls:
        self.handles = [
            self.model.register_forward_pre_hook(self._entered, with_kwargs=True),
            self.model.register_forward_hook(self._returned),
        ]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()

    def _entered(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.open += 1
        self.given = kwargs if kwargs and not args else args[0] if len(args) == 1 and not kwargs else args

    def _returned(self, module: nn.Module, args: Any, output: Any) -> None:
        self.open -= 1

    @property
    def raised_inside(self) -> bool:
        return self.open > 0


def _forward_error(
    name: str, task: Task, model: nn.Module, inputs: Any, calls: _ModelCalls, exc: Exception
) -> ConfigError:
    """The model raised on the data's own inputs (the built-in model call): the model's key. Any
    other failure is the task's: its own code raised, or it gave the model something it refused."""
    model_name = _model_target(model)
    if calls.raised_inside and task.plain_forward:
        return ConfigError(
            "model",
            model_name,
            f"a model that accepts the task's inputs {describe(inputs)} (2 training samples)",
            f"task {name} called it and it raised {_said(exc)}. {SHAPE_HINT}",
        )
    if calls.raised_inside:
        return ConfigError(
            "task",
            name,
            f"a step that calls the model with what it accepts; the batches are {describe(inputs)}",
            f"the task called the model ({model_name}) with {describe(calls.given)} and the model raised "
            f"{_said(exc)}. Check what the task passes the model (which item of the batch), or make the "
            "model take it (e.g. model.in_features, by default ${data.num_features})",
        )
    return ConfigError(
        "task",
        name,
        f"a task whose step runs on the data set's batches {describe(inputs)}",
        f"the task's own code raised {_said(exc)}{_where(exc)}. It runs on 2 training samples before any "
        "rank starts: fix it there (a missing import, a name, the batch's structure)",
    )


def _samples(data: Any, key: str) -> list[Any]:
    """Two samples, by index (map-style) or the stream's first two (an IterableDataset)."""
    try:
        return first_samples(data, 2)
    except Exception as exc:
        raise ConfigError(
            key,
            type(data).__name__,
            "a map-style Dataset (len and [index]) or an IterableDataset",
            f"reading its first samples raised {_said(exc)}.",
        ) from None


def _collate(samples: list[Any], key: str) -> Any:
    try:
        return default_collate(samples)
    except Exception as exc:
        raise ConfigError(
            key,
            describe(samples[0]),
            "samples the default collate can stack: tensors, numbers, or tuples/dicts of them",
            f"collating two samples raised {_said(exc)}; return tensors of equal shape per field.",
        ) from None


def _same_structure(train_sample: Any, val_sample: Any) -> None:
    def signature(sample: Any) -> tuple[Any, list[Any]]:
        leaves, spec = pytree.tree_flatten(sample)
        kinds = [(tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else type(v) for v in leaves]
        return spec, kinds

    if signature(train_sample) != signature(val_sample):
        raise ConfigError(
            "data.val",
            describe(val_sample),
            f"samples shaped like the training set's: {describe(train_sample)}",
            "build the validation set like the training set (data.val._target_ and its arguments), "
            "or set data.val=null for no validation.",
        )


def _check_pipeline(run: Run, task: Task, inputs: Any, target: Any) -> None:
    from disttrain.strategies import specs

    spec = specs.get(run.strategy.name)
    if not spec.one_tensor_batches:
        return
    if not task.plain_forward or not isinstance(inputs, torch.Tensor) or not isinstance(target, torch.Tensor):
        raise ConfigError(
            "strategy",
            spec.name,
            "a task whose model call is model(inputs) with one input tensor and one target tensor",
            f"{_target(run)} gives the model {describe(inputs)} and the loss {describe(target)}; pipeline "
            "stages pass one tensor from stage to stage and compute the loss on the last one, so keyword "
            "arguments, several inputs or a loss inside the model cannot be split. Use strategy=fsdp or "
            "ddp for this task.",
        )


def _check_targets(run: Run, task: Task, train: Any, sample_target: Any) -> None:
    """Labels against the output width, target dtypes against the loss: values need the data."""
    if isinstance(task, Regression) and isinstance(sample_target, torch.Tensor):
        if not sample_target.is_floating_point():
            raise ConfigError(
                "data.targets",
                run.data.targets,
                "float targets for task=regression",
                f"the data set gives {describe(sample_target)}; with the built-in data sets set "
                "data.targets=values, with your own return float targets.",
            )
        return
    if not isinstance(task, (Classification, LanguageModel)) or not isinstance(sample_target, torch.Tensor):
        return
    _check_token_ids(run, train)
    labels = _all_targets(task, train, sample_target)
    if labels.is_floating_point() or labels.numel() == 0:
        return
    classes = run.data.num_classes
    ignore = getattr(task.criterion, "ignore_index", None)
    valid = labels[labels != ignore] if ignore is not None else labels
    low, high = int(valid.min()), int(valid.max())
    if isinstance(classes, int) and (low < 0 or high >= classes):
        raise ConfigError(
            "data.num_classes",
            classes,
            f"more than the largest label: the training labels run from {low} to {high}",
            f"set data.num_classes={high + 1} (the model's output width follows it), or remap the labels "
            "to 0..num_classes-1.",
        )


def _check_token_ids(run: Run, train: Any) -> None:
    """data=tokens: every id of the token files below data.num_classes (the embedding's rows)."""
    classes = run.data.num_classes
    if not isinstance(classes, int) or not hasattr(train, "first_id_at_least"):
        return
    found = train.first_id_at_least(classes)
    if found is not None:
        path, position, token = found
        raise ConfigError(
            "data.num_classes",
            classes,
            f"more than every token id in the data: {path} holds id {token} at token {position}",
            f"set data.num_classes (the vocabulary size) to at least {token + 1}, or check data.dtype "
            f"({run.data.kwargs.get('dtype')}) and that the file was written with the tokenizer this model uses.",
        )


def _all_targets(task: Task, train: Any, sample_target: torch.Tensor) -> torch.Tensor:
    """Every training label when the data set holds them in memory (a TensorDataset), else the sample's."""
    tensors = getattr(train, "tensors", None)
    if isinstance(tensors, tuple):
        try:
            target = task.unpack(tensors)[1]
            if isinstance(target, torch.Tensor):
                return target
        except Exception:
            pass
    return sample_target


def _target(run: Run) -> str:
    return "None" if run.task is None else run.task.target  # None: a run without one reaches the dry step


def _model_target(model: nn.Module) -> str:
    return f"{type(model).__module__}.{type(model).__qualname__}"


def _where(exc: BaseException) -> str:
    """` (at FILE:LINE)`: the innermost frame of the traceback outside torch, Hydra and the standard
    library, which is the line of the task's code that raised or called what raised."""
    import sysconfig
    import traceback

    site = Path(torch.__file__).parent.parent
    libraries = (f"{site / 'torch'}{os.sep}", f"{site / 'hydra'}{os.sep}")

    def library(filename: str) -> bool:
        stdlib = filename.startswith(sysconfig.get_paths()["stdlib"]) and "-packages" not in filename
        return stdlib or filename.startswith(libraries)

    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not library(f.filename)]
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def _said(exc: BaseException) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first[:300]}" if first else type(exc).__name__
