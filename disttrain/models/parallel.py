"""How a model says it can be split: pipeline layers and tensor-parallel plans.

Two small, optional protocols, so any `nn.Module` can opt in without inheriting from anything:

- ``pipeline_layers() -> list[(name, module)]``: modules whose composition in order *is* the
  forward pass, named by their fully qualified names in the model (``layers.0``, ``layers.1``...),
  so split points are written with the same names and a stage's state dict keeps them.
  An ``nn.Sequential`` model needs nothing: its children are its layers.
- ``tp_plan() -> dict[str, ParallelStyle]``: the `parallelize_module` plan (module name -> style).
  For a model you cannot edit, register a plan by class path instead:
  ``TP_PLANS["mylab.nets.Net"] = "mylab.plans:net_plan"`` (a function ``plan(model) -> dict``).
  A transformer block follows the MLP's pattern twice (Megatron-style): q, k, v and the MLP's first
  Linear column-wise, the attention output and the MLP's second Linear row-wise; its forward must
  reshape with ``-1`` heads (a rank holds n_heads / tp of them); norms and embeddings may stay plain.

No torch import at module top: the config checks read the registry before any rank starts.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

# class path ("package.module.Class") -> "package.module:function(model) -> plan"
TP_PLANS: dict[str, str] = {"disttrain.models.gpt.GPT": "disttrain.models.gpt:gpt_tp_plan"}


def class_path(model: Any) -> str:
    cls = type(model)
    return f"{cls.__module__}.{cls.__qualname__}"


def register_tp_plan(cls_path: str, plan_fn: str) -> None:
    """Give a model class you do not own a tensor-parallel plan (``"module:function"``)."""
    TP_PLANS[cls_path] = plan_fn


def tp_plan_fn(model: Any) -> Callable[[], dict[str, Any]] | None:
    """The model's plan factory: its own ``tp_plan`` method, else the registry, else None."""
    method = getattr(model, "tp_plan", None)
    if callable(method):
        return method
    target = TP_PLANS.get(class_path(model))
    if target is None:
        return None
    module, _, fn = target.partition(":")
    factory = getattr(importlib.import_module(module), fn)
    return lambda: factory(model)


def has_forward(module: nn.Module) -> bool:
    """Whether the module runs a forward of its own (its class overrides `nn.Module.forward`):
    containers (ModuleList, ModuleDict) do not, and `fully_shard` refuses them."""
    from torch import nn

    return type(module).forward is not nn.Module.forward


def shared_across_layers(layers: list[tuple[str, nn.Module]]) -> list[str]:
    """Parameters that appear in more than one pipeline layer (tied weights): stages on different
    ranks would each train their own copy, so pipeline parallelism refuses them."""
    owner: dict[int, str] = {}
    shared: list[str] = []
    for layer_name, layer in layers:
        for pname, p in layer.named_parameters():
            if id(p) in owner and owner[id(p)] != layer_name:
                shared.append(f"{owner[id(p)]} / {layer_name}.{pname}")
            owner.setdefault(id(p), layer_name)
    return shared


def pipeline_layers(model: nn.Module) -> list[tuple[str, nn.Module]] | None:
    """The model as an ordered list of (name, layer) whose composition is its forward, or None."""
    from torch import nn

    method = getattr(model, "pipeline_layers", None)
    if callable(method):
        return list(method())
    if isinstance(model, nn.Sequential):
        return list(model.named_children())
    return None


def stage_bounds(names: list[str], num_stages: int, split_points: list[str] | None) -> list[int]:
    """Layer indices where stages begin, plus len(names): [0, b1, ..., len(names)].

    With split points, each names the first layer of a new stage. Without, the layers are cut into
    `num_stages` contiguous runs whose lengths differ by at most one (earlier stages get the extra).
    Raises ValueError with the numbers when the cut is impossible.
    """
    n = len(names)
    if split_points:
        unknown = [p for p in split_points if p not in names]
        if unknown:
            raise ValueError(f"split points {unknown} are not layer names; the layers are {names}")
        starts = [names.index(p) for p in split_points]
        if starts != sorted(set(starts)) or starts[0] == 0:
            raise ValueError(
                f"split points {split_points} must be distinct, in layer order and not the first layer"
            )
        if len(starts) + 1 != num_stages:
            raise ValueError(
                f"{len(split_points)} split points make {len(starts) + 1} stages, not {num_stages}"
            )
        return [0, *starts, n]
    if num_stages > n:
        raise ValueError(f"{num_stages} stages but only {n} splittable layers")
    base, extra = divmod(n, num_stages)
    bounds = [0]
    for s in range(num_stages):
        bounds.append(bounds[-1] + base + (1 if s < extra else 0))
    return bounds
