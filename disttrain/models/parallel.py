"""How a model says it can be split: pipeline layers and tensor-parallel plans.

Two small, optional protocols, so any `nn.Module` can opt in without inheriting from anything:

- ``pipeline_layers() -> list[(name, module)]``: modules whose composition in order *is* the
  forward pass, named by their fully qualified names in the model (``layers.0``, ``layers.1``...),
  so split points are written with the same names and a stage's state dict keeps them.
  An ``nn.Sequential`` model needs nothing: its children are its layers.
- ``tp_plan() -> dict[str, ParallelStyle]``: the `parallelize_module` plan (module name -> style).
  For a model you cannot edit, write the plan in config (``strategy.tp_plan``: a mapping of module
  name patterns to style names, or a ``_target_`` factory called with the model), or register it by
  class path in the `TP_PLANS` registry: ``TP_PLANS.register(TPPlanSpec("mylab.nets.Net",
  "mylab.plans:net_plan"))`` (``plan(model) -> dict``), or from a package of yours through the
  ``disttrain.tp_plans`` entry-point group, as every plug-in kind (`disttrain.config.registry`).
  A Hugging Face model whose config carries a ``base_model_tp_plan`` brings its own (`hf_tp_plan`).
  A transformer block follows the MLP's pattern twice (Megatron-style): q, k, v and the MLP's first
  Linear column-wise, the attention output and the MLP's second Linear row-wise; its forward must
  reshape with ``-1`` heads (a rank holds n_heads / tp of them); norms and embeddings may stay plain.

No torch import at module top: the config checks read the registry before any rank starts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from fnmatch import fnmatch
from typing import TYPE_CHECKING, Any

from disttrain.config.registry import Registry, load_target

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True)
class TPPlanSpec:
    """A tensor-parallel plan for a model class: `name` is its class path ("package.module.Class"),
    `target` a "module:function" called with the model that returns the plan; one line of `help`."""

    name: str
    target: str
    help: str = ""


TP_PLANS: Registry[TPPlanSpec] = Registry(
    "tp_plans",
    key="model",
    spec_type=TPPlanSpec,
    builtin=(__name__,),
    hint="register a plan for the model's class: TP_PLANS.register(TPPlanSpec(class path, 'module:function')).",
    describe=lambda spec: spec.target,
)
GPT_PLAN = TP_PLANS.register(
    TPPlanSpec("disttrain.models.gpt.GPT", "disttrain.models.gpt:gpt_tp_plan", "Megatron-style blocks")
)

TP_PLAN_KEY = "strategy.tp_plan"
# The style names `strategy.tp_plan` takes -> what each builds (torch.distributed.tensor.parallel):
STYLES = {
    "colwise": "ColwiseParallel(): weight split by output features; replicated input, sharded output",
    "rowwise": "RowwiseParallel(): weight split by input features; sharded input, all-reduced output",
    "colwise_rep": "ColwiseParallel(output_layouts=Replicate()): column-wise, output gathered",
    "rowwise_rep": "RowwiseParallel(input_layouts=Replicate()): row-wise on a replicated input "
    "(vocabulary-parallel embeddings)",
    "sequence": "SequenceParallel(): parameters replicated, activations sharded on the sequence dim",
}
# Hugging Face's style strings (transformers' ALL_PARALLEL_STYLES) that mean one of STYLES, or None:
# "replicate" keeps the full parameter on every rank, which a module left out of the plan does.
# The others (packed_*, local*, moe_*, sequence_parallel, ...) rely on transformers' own layers and
# hooks (local tensors, fused weights, its colwise re-gathering a sequence-sharded input): refused.
HF_STYLES: dict[str, str | None] = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "colwise_rep": "colwise_rep",
    "colwise_gather_output": "colwise_rep",
    "embedding_colwise": "colwise_rep",
    "rowwise_rep": "rowwise_rep",
    "rowwise_split_input": "rowwise_rep",
    "embedding_rowwise": "rowwise_rep",
    "replicate": None,
}


def class_path(model: Any) -> str:
    cls = type(model)
    return f"{cls.__module__}.{cls.__qualname__}"


def build_style(name: str) -> Any:
    """The torch ParallelStyle a style name of STYLES stands for."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    if name == "colwise":
        return ColwiseParallel()
    if name == "rowwise":
        return RowwiseParallel()
    if name == "colwise_rep":
        return ColwiseParallel(output_layouts=Replicate())
    if name == "rowwise_rep":
        return RowwiseParallel(input_layouts=Replicate())
    if name == "sequence":
        return SequenceParallel()
    raise KeyError(name)


def hf_tp_plan(model: Any) -> dict[str, str] | None:
    """A Hugging Face model's own plan (HF style strings), when its config has `base_model_tp_plan`:
    the model's resolved `tp_plan` (transformers >= 5: keys prefixed with the base model's name, the
    head's entry added), else the config's plan prefixed with the base model's name."""
    base_plan = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
    if not base_plan:
        return None
    for attr in ("tp_plan", "_tp_plan"):
        resolved = getattr(model, attr, None)
        if isinstance(resolved, dict) and resolved and all(isinstance(v, str) for v in resolved.values()):
            return dict(resolved)
    base = getattr(model, "base_model", model)
    prefix = next((name for name, m in model.named_modules() if m is base), "")
    return {f"{prefix}.{k}" if prefix else k: v for k, v in base_plan.items()}


def plan_from_names(plan: dict[str, str], source: str, hf: bool = False) -> dict[str, Any]:
    """{pattern: style name} -> {pattern: ParallelStyle}; a name it cannot map is a ConfigError."""
    from disttrain.config.errors import ConfigError, one_of

    table: dict[str, str | None] = HF_STYLES if hf else {k: k for k in STYLES}
    bad = {k: v for k, v in plan.items() if not isinstance(v, str) or v not in table}
    if bad:
        pattern, style = next(iter(bad.items()))
        if hf:
            raise ConfigError(
                TP_PLAN_KEY,
                None,
                f"a plan disttrain can apply; the model's {source} uses {style!r} for {pattern!r}, and "
                f"the Hugging Face styles that map to torch's are {', '.join(HF_STYLES)}",
                f"{style!r} needs transformers' own tensor-parallel layers; write the plan yourself: "
                f"strategy.tp_plan={{PATTERN: STYLE}} with STYLE {one_of(STYLES)}.",
            )
        raise ConfigError(
            TP_PLAN_KEY,
            bad,
            f"style names {one_of(STYLES)}",
            "e.g. 'strategy.tp_plan={layers.*.attn.q: colwise, layers.*.attn.proj: rowwise}'; or a "
            "_target_ factory (called with the model) returning torch ParallelStyle objects.",
        )
    return {k: build_style(name) for k, v in plan.items() if (name := table[v]) is not None}


def configured_plan(model: Any, node: Any) -> dict[str, Any]:
    """`strategy.tp_plan` as torch styles: a mapping of style names, or a `_target_` factory."""
    from disttrain.config.errors import ConfigError

    if not isinstance(node, dict):
        raise ConfigError(
            TP_PLAN_KEY,
            node,
            "null, a mapping {module pattern: style name}, or a node with _target_",
            "e.g. 'strategy.tp_plan={layers.*.fc1: colwise, layers.*.fc2: rowwise}'.",
        )
    if "_target_" not in node:
        return plan_from_names(node, TP_PLAN_KEY)
    from disttrain.config.instantiate import build

    plan = build({**node, "_partial_": True}, TP_PLAN_KEY, supplied=1)(model)
    if not isinstance(plan, dict) or not plan:
        raise ConfigError(
            f"{TP_PLAN_KEY}._target_",
            node["_target_"],
            "a factory that returns a non-empty dict {module pattern: ParallelStyle or style name}",
            f"it returned {type(plan).__name__}; e.g. return {{'layers.*.fc1': ColwiseParallel()}}.",
        )
    names = {k: v for k, v in plan.items() if isinstance(v, str)}
    return {**plan, **plan_from_names(names, TP_PLAN_KEY)}


def plan_matches(model: Any, pattern: str) -> list[str]:
    """The module names `pattern` selects, as `parallelize_module` reads it: one fnmatch pattern per
    dotted level of child names (`layers.*.attn.q`); the empty pattern is the model itself."""
    if pattern == "":
        return [""]
    head, _, rest = pattern.partition(".")
    found: list[str] = []
    for name, child in model.named_children():
        if fnmatch(name, head):
            found += [f"{name}.{m}" for m in plan_matches(child, rest)] if rest else [name]
    return found


def tp_plan_source(model: Any, configured: Any = None) -> tuple[str, Callable[[], dict[str, Any]]] | None:
    """Where the model's tensor-parallel plan comes from (for messages) and its factory, or None:
    `strategy.tp_plan` when set (`configured`); else the model's own ``tp_plan()`` method; else the
    TP_PLANS registry; else a Hugging Face model's base_model_tp_plan (`hf_tp_plan`)."""
    if configured is not None:
        return TP_PLAN_KEY, lambda: configured_plan(model, configured)
    method = getattr(model, "tp_plan", None)
    if callable(method):
        return f"{class_path(model)}.tp_plan()", method
    path = class_path(model)
    if path in TP_PLANS.names():
        factory = load_target(TP_PLANS.get(path).target)
        return f"TP_PLANS[{path!r}]", lambda: factory(model)
    hf = hf_tp_plan(model)
    if hf is not None:
        return "config.base_model_tp_plan", lambda: plan_from_names(hf, "config.base_model_tp_plan", hf=True)
    return None


def tp_plan_fn(model: Any, configured: Any = None) -> Callable[[], dict[str, Any]] | None:
    """The plan factory (see `tp_plan_source`), or None when the model has no plan."""
    found = tp_plan_source(model, configured)
    return None if found is None else found[1]


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
