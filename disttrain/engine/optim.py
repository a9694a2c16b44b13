"""Optimizer (a `_partial_` Hydra target) over parameter groups, and the learning-rate schedule."""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from disttrain.config.errors import ConfigError
from disttrain.config.instantiate import build, locate
from disttrain.config.names import NO_DECAY, NO_DECAY_1D
from disttrain.config.schema import Optim, ScaleLr, Sched, TrainerConfig
from disttrain.config.typed import typed

log = logging.getLogger("disttrain")


def effective_lr(optim: Optim, world_size: int) -> float:
    """The linear scaling rule (Goyal et al. 2017) when `optim.scale_lr=linear`."""
    return optim.lr * world_size if optim.scale_lr == ScaleLr.linear else optim.lr


def build_optimizer(
    optim: Optim,
    model: torch.nn.Module | Iterable[torch.nn.Parameter],
    world_size: int,
    checking: bool = False,
) -> torch.optim.Optimizer:
    """The optimizer over `model`'s parameters, grouped as `optim.param_groups` says.

    `model` is the module the strategy returned (DDP, FSDP2 with DTensor parameters, a pipeline
    stage, ...); the groups are torch param-group dicts, which ZeRO and post-local SGD keep.
    `checking`: built only to be checked, never stepped (the pre-launch checks: see `for_checks`).
    """
    lr = effective_lr(optim, world_size)
    spec = {"_target_": optim.target, "_partial_": True, **optim.kwargs, "lr": lr}
    if lr != optim.lr:
        log.info("optim.scale_lr=linear: lr %.3g x world size %d = %.3g", optim.lr, world_size, lr)
    if optim.weight_decay or "weight_decay" in _arguments(optim.target, "optim._target_"):
        spec["weight_decay"] = optim.weight_decay  # 0 means none: LBFGS, SparseAdam have no such argument
    groups = param_groups(optim.param_groups, model)
    groups = _listed(groups)  # read twice: by `use_fused` and by the class
    fused = use_fused(optim.fused, spec, groups)
    if fused is not None:
        spec["fused"] = fused
    factory = build(spec, "optim", supplied=1)  # the parameters are passed below
    if checking:
        factory = for_checks(factory)
    optimizer: torch.optim.Optimizer = factory(groups)
    return optimizer


def use_fused(choice: Any, spec: dict[str, Any], groups: list[Any]) -> bool | None:
    """The `fused` argument the optimizer gets: None (none: the class's default, foreach on CUDA),
    True or False.

    `optim.fused=true|false` (the pre-launch checks allow nothing else) is passed as set; a class
    without the argument is a ConfigError.
    `auto` is True when every parameter is a floating CUDA tensor (or a DTensor on CUDA), the class
    takes `fused` (AdamW, Adam, SGD, Adagrad) and the user did not choose `foreach` themselves: one
    kernel per parameter group instead of ~12 foreach launches per step (FSDP2's DTensor parameters
    dispatch each of them on the host), as torchtitan does."""
    takes = "fused" in _arguments(spec["_target_"], "optim._target_")
    if choice != "auto":
        if not takes:
            raise ConfigError(
                "optim.fused",
                choice,
                f"auto with optim._target_={spec['_target_']}, which takes no `fused` argument",
                "leave optim.fused=auto (nothing is fused where the class cannot).",
            )
        return bool(choice)
    params = [p for g in groups for p in (g["params"] if isinstance(g, dict) else [g])]
    cuda = bool(params) and all(p.is_floating_point() and p.device.type == "cuda" for p in params)
    if not (takes and cuda and spec.get("foreach") is None):
        return None
    log.info("optim.fused=auto: fused %s kernels (every parameter is on CUDA)", spec["_target_"])
    return True


def _listed(groups: Any) -> list[Any]:
    """Parameters or param-group dicts as a list, each group's params a list (a generator is read
    once, and torch accepts a list wherever it accepts an iterable)."""
    out = []
    for g in groups:
        if isinstance(g, dict):
            params = g["params"]
            g = {**g, "params": [params] if isinstance(params, torch.Tensor) else list(params)}
        out.append(g)
    return out


def for_checks(factory: Any) -> Any:
    """`factory` (a partial of an optimizer class) building a subclass whose `add_param_group` is the
    class's own without torch's `_disable_dynamo` wrapper (functools.wraps keeps it as `__wrapped__`).

    That wrapper imports torch._dynamo at its first call (~0.9 CPU-s with sympy, in the launcher
    that only checks the config and never compiles or steps) to tell dynamo not to trace the call;
    the function it wraps is the same code, and its checks and errors are the same. torch itself is
    left as it is: only the throwaway optimizer of the check is of the subclass. A factory that is
    not a partial of a class, or a class without the wrapper, is returned as it is."""
    import functools

    cls = getattr(factory, "func", None)
    wrapped = getattr(getattr(cls, "add_param_group", None), "__wrapped__", None)
    if not isinstance(factory, functools.partial) or not isinstance(cls, type) or wrapped is None:
        return factory
    checked = type(cls.__name__, (cls,), {"add_param_group": wrapped, "__module__": cls.__module__})
    return functools.partial(checked, *factory.args, **factory.keywords)


def param_groups(choice: Any, model: torch.nn.Module | Iterable[torch.nn.Parameter]) -> Any:
    """null: every parameter in one group; NO_DECAY, NO_DECAY_1D: see no_decay_groups; a `_target_` node: the
    user's factory, called with the model, returns param groups (or parameters)."""
    if choice is None:  # frozen parameters (peft=lora's base) get no group: they never step
        return (
            [p for p in model.parameters() if p.requires_grad]
            if isinstance(model, torch.nn.Module)
            else model
        )
    if not isinstance(model, torch.nn.Module):
        raise TypeError("optim.param_groups needs the model, not its parameters")
    if choice in (NO_DECAY, NO_DECAY_1D):
        return no_decay_groups(model, embeddings_decay=choice == NO_DECAY_1D)
    if isinstance(choice, dict):
        factory = build({**choice, "_partial_": True}, "optim.param_groups", supplied=1)  # the model
        groups = list(factory(model))
        if not groups:
            raise ConfigError(
                "optim.param_groups._target_",
                choice.get("_target_"),
                "a factory that returns at least one parameter group",
                "return e.g. [{'params': decay}, {'params': rest, 'weight_decay': 0.0}].",
            )
        return groups
    raise ConfigError(
        "optim.param_groups",
        choice,
        f"null, {NO_DECAY_1D}, {NO_DECAY}, or a node with _target_ (a factory called with the model)",
        f"optim.param_groups={NO_DECAY_1D} exempts 1-D parameters (biases, norms) from weight decay "
        f"(nanoGPT); {NO_DECAY} exempts embeddings too.",
    )


def no_decay_groups(model: torch.nn.Module, embeddings_decay: bool = False) -> list[dict[str, Any]]:
    """Weight decay on >= 2-D parameters; 1-D ones (biases, norm weights) get weight_decay 0.
    `embeddings_decay` (NO_DECAY_1D): that is all, nanoGPT's `configure_optimizers` rule. Otherwise
    (NO_DECAY, minGPT-style) the weights of nn.Embedding/EmbeddingBag modules (and a head tied to
    one) are exempt too. HF's Trainer exempts biases and norms by name: close to NO_DECAY_1D."""
    embeddings = (
        set()
        if embeddings_decay
        else {
            id(p)
            for m in model.modules()
            if isinstance(m, torch.nn.Embedding | torch.nn.EmbeddingBag)
            for p in m.parameters(recurse=False)
        }
    )
    decay: list[torch.nn.Parameter] = []
    exempt: list[torch.nn.Parameter] = []
    for p in model.parameters():  # each shared (tied) parameter once
        if not p.requires_grad:
            continue
        (exempt if p.ndim < 2 or id(p) in embeddings else decay).append(p)
    groups: list[dict[str, Any]] = [{"params": decay}, {"params": exempt, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def lr_lambda(sched: Sched, total_steps: int) -> Any:
    """Multiplier of the base lr at optimizer step `s`: linear warm-up, then constant or cosine."""
    warmup, name, floor = sched.warmup_steps, sched.name, sched.min_lr_ratio  # constant: no floor

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if name == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def build_scheduler(sched: Sched, optimizer: torch.optim.Optimizer, total_steps: int) -> LRScheduler:
    """The built-in warm-up + constant/cosine (`sched.name`), or any scheduler class the
    `sched._target_` names (a partial: the optimizer is passed here). Stepped once per optimizer
    step. A target with a `total_steps` argument (OneCycleLR) gets the run's, unless set."""
    if sched.target is None:
        return LambdaLR(optimizer, lr_lambda(sched, total_steps))
    extra: dict[str, Any] = {}
    accepted = _arguments(sched.target, "sched._target_")
    if "total_steps" in accepted and not {"total_steps", "epochs"} & set(sched.kwargs):
        extra["total_steps"] = total_steps
    spec = {"_target_": sched.target, "_partial_": True, **sched.kwargs}
    factory = build(spec, "sched", supplied=1, **extra)  # the optimizer is passed below
    scheduler = factory(optimizer) if callable(factory) and not isinstance(factory, LRScheduler) else factory
    if not isinstance(scheduler, LRScheduler):
        raise ConfigError(
            "sched._target_",
            sched.target,
            "a torch.optim.lr_scheduler class (or a factory returning one), built with _partial_: true",
            "e.g. sched._target_=torch.optim.lr_scheduler.StepLR sched.step_size=100.",
        )
    return scheduler


def _arguments(target: Any, key: str) -> set[str]:
    """Names `target` takes (empty when it has no inspectable signature)."""
    try:
        return set(inspect.signature(locate(target, key)).parameters)
    except (TypeError, ValueError):
        return set()


def total_steps(trainer: TrainerConfig | dict[str, Any], batches_per_epoch: int) -> int:
    """Optimizer steps the run will take: max_steps, or max_epochs x full accumulation groups.
    Here, not in engine.loop: the pre-launch checks need it without the loop's imports (DCP, DTensor)."""
    trainer = typed(TrainerConfig, trainer)  # the pre-launch checks pass the plain slice
    per_epoch = batches_per_epoch // trainer.grad_accum
    return trainer.max_steps if trainer.max_steps > 0 else trainer.max_epochs * per_epoch
