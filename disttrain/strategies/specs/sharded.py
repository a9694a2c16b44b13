"""Specs of the sharded data-parallel family, both run by FSDP2 (`fully_shard`):

- fsdp: parameters, gradients and optimizer state sharded (ZeRO-3); `replicate=R` is HSDP
  (`strategy=hsdp` is this spec with replicate 2);
- zero2: the same with `reshard_after_forward=False`: gathered parameters stay from forward to
  backward (ZeRO-2's memory, ddp's traffic), gradients and optimizer state sharded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from omegaconf import II

from disttrain.config.common import ComputeDtype, world_shape
from disttrain.config.common import help_field as h
from disttrain.config.errors import ConfigError, check_divides
from disttrain.strategies.specs.core import (
    PlanRow,
    PlanShape,
    StrategyConfig,
    StrategySpec,
    at_least,
    data_parallel_row,
    register,
)
from disttrain.strategies.specs.data_parallel import warn_single_rank
from disttrain.strategies.specs.layout import Layout

if TYPE_CHECKING:
    from disttrain.config.run import Run


@dataclass
class FSDPStrategyConfig(StrategyConfig):
    name: str = "fsdp"
    wrap_classes: list[str] = h(
        "module class names that each get their own FSDP unit, e.g. [Block]; empty: the model's "
        "repeated blocks (a class occurring >= 2 times in a ModuleList/Sequential)",
        factory=list,
    )
    min_num_params: int = h(
        "also wrap modules outside those units holding >= this many not-yet-wrapped params; 0: off",
        100_000,
    )
    reshard_after_forward: bool = h(
        "free gathered params after forward (less memory, one more all-gather); never the root's, "
        "nor on a shard group of one rank",
        True,
    )
    cpu_offload: bool = h("keep sharded params, grads and optimizer state in CPU memory", False)
    replicate: int = h("HSDP: replicas R; mesh (R, world/R), sharded within a replica; 1: plain FSDP", 1)
    param_dtype: ComputeDtype = h(
        "dtype of gathered params for compute: float32, bfloat16, float16", II("amp.dtype")
    )
    reduce_dtype: ComputeDtype = h(
        "dtype of the gradient reduce-scatter: float32, bfloat16, float16", ComputeDtype.float32
    )


@dataclass
class Zero2StrategyConfig(FSDPStrategyConfig):
    name: str = "zero2"
    reshard_after_forward: bool = h(
        "false: gathered params stay from forward to backward (ZeRO-2); true would be strategy=fsdp", False
    )


def check_fsdp(run: Run, s: FSDPStrategyConfig) -> None:
    warn_single_rank(run, s.name)
    ws = run.world.size
    replicate = at_least(
        "replicate", s.replicate, 1, "1 is plain FSDP; R > 1 is HSDP with mesh (R, world/R)."
    )
    check_divides(
        "strategy.replicate",
        replicate,
        ws,
        world_shape(run),
        f"HSDP lays the ranks out as a (replicate, shard) mesh, so replicate x shard must be {ws}.",
    )
    at_least("min_num_params", s.min_num_params, 0, "0 turns size-based wrapping off.")


def check_zero2(run: Run, s: Zero2StrategyConfig) -> None:
    if s.reshard_after_forward:
        raise ConfigError(
            "strategy.reshard_after_forward",
            True,
            f"false with strategy={s.name}",
            "zero2 is FSDP2 that keeps gathered parameters until backward; to reshard after forward "
            "use strategy=fsdp.",
        )
    check_fsdp(run, s)


def check_fsdp_model(run: Run, s: FSDPStrategyConfig, model: Any, gpus: int) -> None:
    """What `fully_shard` would refuse in the ranks, found on the model built on the meta device:
    wrap classes that are not in the model or are containers, scalar parameters, a container root."""
    from disttrain.models.parallel import class_path, has_forward

    check_wrap_classes(s, model)
    scalars = [name for name, p in model.named_parameters() if p.dim() == 0]
    if scalars:
        raise ConfigError(
            "model",
            class_path(model),
            f"a model without 0-dim (scalar) parameters with strategy={s.name}",
            f"fully_shard shards every parameter along its first dimension and refuses scalars: "
            f"{', '.join(scalars[:5])}; make them 1-element tensors (torch.zeros(1), not torch.tensor(0.0)) "
            "in your model, or use strategy=ddp or zero.",
        )
    if not has_forward(model):
        raise ConfigError(
            "model",
            class_path(model),
            "a module with a forward (the root is always an FSDP unit)",
            f"{type(model).__name__} is a container; return a module that runs it (e.g. nn.Sequential).",
        )
    check_contiguous(s, model)


def check_contiguous(s: Any, model: Any) -> None:
    """fully_shard refuses parameters that are not contiguous (channels_last convolution weights:
    `model.to(memory_format=torch.channels_last)`), in every rank after launch; found here on meta."""
    from disttrain.models.parallel import class_path

    strided = [(n, tuple(p.stride())) for n, p in model.named_parameters() if not p.is_contiguous()]
    if strided:
        shown = ", ".join(f"{n} (stride {st})" for n, st in strided[:3])
        raise ConfigError(
            "model",
            class_path(model),
            f"contiguous parameters with strategy={s.name}",
            f"fully_shard refuses non-contiguous parameters: {shown}; channels_last weights are; "
            "drop `.to(memory_format=torch.channels_last)` from the model (the convolutions still "
            "take channels_last inputs), or use strategy=ddp.",
        )


def check_wrap_classes(s: FSDPStrategyConfig, model: Any) -> None:
    """The wrap classes must name modules of this model that run a forward of their own."""
    from disttrain.models.parallel import has_forward

    if not s.wrap_classes:
        return
    modules = list(model.modules())
    present = sorted({type(m).__name__ for m in modules})
    wrappable = sorted({type(m).__name__ for m in modules if has_forward(m)})
    missing = [c for c in s.wrap_classes if c not in present]
    if missing:
        raise ConfigError(
            "strategy.wrap_classes",
            missing,
            f"class names of modules in this model: {', '.join(present)}",
            "write the class name only (Linear, not torch.nn.Linear), or leave wrap_classes empty: "
            "the default wraps the model's repeated blocks.",
        )
    containers = [c for c in s.wrap_classes if c not in wrappable]
    if containers:
        raise ConfigError(
            "strategy.wrap_classes",
            containers,
            f"classes of modules with a forward of their own: {', '.join(wrappable)}",
            "fully_shard refuses containers without forward (ModuleList, ModuleDict): name the class "
            "of the layers they hold, or leave wrap_classes empty for the model's repeated blocks.",
        )


def plan_fsdp(shape: PlanShape) -> list[PlanRow]:
    """fsdp over every rank; with several nodes also hsdp (sharded in a node, replicated across)."""
    rows = [
        data_parallel_row(
            "fsdp", shape, preference=50, zero=3, note="ZeRO-3: everything sharded; 1.5x ddp's traffic"
        )
    ]
    if shape.nodes > 1:
        run = f"strategy=hsdp strategy.replicate={shape.nodes}"
        note = "sharded within a node, replicated across nodes"
        hsdp = Layout(shape.world, dp_replicate=shape.nodes, dp_shard=shape.per_node, zero=3)
        rows.append(PlanRow("hsdp", hsdp, run, 40, note))
    return rows


def plan_zero2(shape: PlanShape) -> list[PlanRow]:
    note = "ZeRO-2: gradients + optimizer state sharded, params gathered in forward; traffic as ddp"
    return [data_parallel_row("zero2", shape, preference=30, zero=2, note=note)]


def sharded(zero: int) -> Callable[[FSDPStrategyConfig, int], Layout]:
    """The layout of FSDP at a ZeRO stage: (replicate, world / replicate), sharded within a replica."""

    def layout(s: FSDPStrategyConfig, world: int) -> Layout:
        return Layout(world, dp_replicate=s.replicate, dp_shard=world // s.replicate, zero=zero)

    return layout


def offloads(s: FSDPStrategyConfig) -> bool:
    """cpu_offload: grads are CPU DTensors, so the grad norm and full state dicts all-reduce and
    all-gather CPU tensors (pytorch#148532)."""
    return bool(s.cpu_offload)


FSDP = register(
    StrategySpec(
        name="fsdp",
        peft=True,
        meta_setup=True,
        config=FSDPStrategyConfig,
        target="disttrain.strategies.fsdp:FSDPStrategy",
        check_static=check_fsdp,
        check_model=check_fsdp_model,
        cpu_collectives=offloads,
        layout=sharded(3),
        plan=plan_fsdp,
    )
)
ZERO2 = register(
    StrategySpec(
        name="zero2",
        peft=True,
        meta_setup=True,
        config=Zero2StrategyConfig,
        target="disttrain.strategies.fsdp:FSDPStrategy",
        check_static=check_zero2,
        check_model=check_fsdp_model,
        cpu_collectives=offloads,
        layout=sharded(2),
        plan=plan_zero2,
    )
)
