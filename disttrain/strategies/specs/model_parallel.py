"""Specs of the strategies that split one model across ranks: pipeline, tp, fsdp+tp.

Ranks that split a model read the same data, so their data-parallel degree is below the world size;
their checks need the model's pipeline layers or tensor-parallel plan (disttrain.models.parallel).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from omegaconf import II

from disttrain.config.common import Choice, ComputeDtype, world_shape
from disttrain.config.common import help_field as h
from disttrain.config.errors import ConfigError, check_divides, one_of
from disttrain.strategies.specs import core
from disttrain.strategies.specs.core import (
    PIPELINE_LAYERS,
    TP_PLAN,
    PlanRow,
    PlanShape,
    StrategyConfig,
    StrategySpec,
    register,
)
from disttrain.strategies.specs.layout import Layout

if TYPE_CHECKING:
    from disttrain.config.run import Run

# torch.distributed.pipelining's schedules; "1f1b" is no Python name, hence the functional form
# (OmegaConf looks a member up by name: each name is its value).
_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
PipelineSchedule = Choice("PipelineSchedule", [(n, n) for n in _SCHEDULES])  # type: ignore[call-overload]


@dataclass
class PipelineStrategyConfig(StrategyConfig):
    name: str = "pipeline"
    schedule: PipelineSchedule = h(  # type: ignore[valid-type]
        "gpipe, 1f1b or interleaved_1f1b (needs stages_per_rank >= 2)", PipelineSchedule["1f1b"]
    )
    n_microbatches: int = h("micro-batches each batch is cut into (must divide trainer.batch_size)", 4)
    stages_per_rank: int = h("stages (virtual stages) per rank; >= 2 only with interleaved_1f1b", 1)
    split_points: list[str] | None = h(
        "layer names that start a new stage, e.g. [layers.4]; null: an even split of the layers", None
    )


@dataclass
class TPStrategyConfig(StrategyConfig):
    name: str = "tp"
    tp_plan: Any = h(
        "null: the model's own plan (tp_plan(), TP_PLANS, a Hugging Face base_model_tp_plan); or "
        "{module name pattern: colwise|rowwise|colwise_rep|rowwise_rep|sequence}; or a _target_ "
        "factory called with the model, returning {pattern: ParallelStyle}",
        None,
    )


@dataclass
class FSDPTPStrategyConfig(TPStrategyConfig):
    name: str = "fsdp+tp"
    tp_degree: int = h("ranks per tensor-parallel group (the fast, inner mesh dimension)", 2)
    dp_degree: int = h("FSDP replicas (outer mesh dimension); -1: world size / tp_degree", -1)
    reshard_after_forward: bool = h(
        "free gathered params after forward (less memory, one more all-gather); never the root's, "
        "nor on a shard group of one rank",
        True,
    )
    param_dtype: ComputeDtype = h(
        "dtype of FSDP-gathered params for compute: float32, bfloat16, float16", II("amp.dtype")
    )
    reduce_dtype: ComputeDtype = h(
        "dtype of the gradient reduce-scatter over dp: float32, bfloat16, float16", ComputeDtype.float32
    )


def fsdp_tp_layout(s: FSDPTPStrategyConfig, world: int) -> Layout:
    """(dp, tp): tp_degree ranks per tensor-parallel group, FSDP over dp_degree (-1: world / tp_degree)."""
    dp = s.dp_degree if s.dp_degree != -1 else world // s.tp_degree
    return Layout(world, dp_shard=max(dp, 1), tp=s.tp_degree, zero=3)


def tp_layout(s: TPStrategyConfig, world: int) -> Layout:
    return Layout(world, tp=world)


def pipeline_layout(s: PipelineStrategyConfig, world: int) -> Layout:
    return Layout(world, pp=world)


# ------------------------------------------------------------------------------------------ static
def needs_two_ranks(run: Run, s: StrategyConfig) -> None:
    if run.world.size < 2:
        raise ConfigError(
            "nproc_per_node",
            run.world.nproc_per_node,
            f">= 2 ranks with strategy={s.name} (world size is {world_shape(run)})",
            f"{s.name} splits one model across ranks: set nproc_per_node=2 (CPU ranks work), "
            "or use strategy=single on one rank.",
        )


def check_tp_plan(s: TPStrategyConfig) -> None:
    """`strategy.tp_plan`: null, a node with _target_, or a mapping of patterns to known style names."""
    from disttrain.models.parallel import STYLES, TP_PLAN_KEY

    plan = s.tp_plan
    if plan is None or (isinstance(plan, dict) and "_target_" in plan):
        return
    example = "'strategy.tp_plan={layers.*.fc1: colwise, layers.*.fc2: rowwise}'"
    if not isinstance(plan, dict) or not plan:
        raise ConfigError(
            TP_PLAN_KEY,
            plan,
            "null (the model's own plan), a mapping {module name pattern: style name}, or a node with "
            "_target_ (a factory called with the model)",
            f"e.g. {example}.",
        )
    bad = {k: v for k, v in plan.items() if v not in STYLES}
    if bad:
        raise ConfigError(
            TP_PLAN_KEY,
            bad,
            f"style names {one_of(STYLES)} ({'; '.join(f'{k}: {v}' for k, v in STYLES.items())})",
            f"e.g. {example}; for other ParallelStyles, a _target_ factory returning them.",
        )


def check_tp_static(run: Run, s: TPStrategyConfig) -> None:
    needs_two_ranks(run, s)
    check_tp_plan(s)


def check_pipeline(run: Run, s: PipelineStrategyConfig) -> None:
    needs_two_ranks(run, s)
    ws = run.world.size
    schedule, m, v, batch = s.schedule, s.n_microbatches, s.stages_per_rank, run.trainer.batch_size
    if m < 1:
        raise ConfigError("strategy.n_microbatches", m, "a number >= 1", "4 to 8 micro-batches per stage.")
    if batch % m:
        divisors = [d for d in range(1, batch + 1) if batch % d == 0]
        raise ConfigError(
            "strategy.n_microbatches",
            m,
            f"a divisor of trainer.batch_size={batch}: {', '.join(map(str, divisors))}",
            f"each micro-batch must be equal: {batch} samples / {m} micro-batches is not whole; "
            "change one of them.",
        )
    if schedule == "interleaved_1f1b" and v < 2:
        raise ConfigError(
            "strategy.stages_per_rank",
            v,
            ">= 2 with schedule=interleaved_1f1b",
            "interleaving needs several (virtual) stages per rank: strategy.stages_per_rank=2.",
        )
    if schedule != "interleaved_1f1b" and v != 1:
        raise ConfigError(
            "strategy.stages_per_rank",
            v,
            f"1 with schedule={schedule}",
            "several stages per rank need strategy.schedule=interleaved_1f1b.",
        )
    if schedule == "1f1b" and m < ws:
        raise ConfigError(
            "strategy.n_microbatches",
            m,
            f">= the number of stages ({ws}) with schedule=1f1b",
            f"set strategy.n_microbatches={ws} or more (a divisor of batch_size {batch}).",
        )
    rounds = max(1, m // ws)
    if schedule == "interleaved_1f1b" and m % rounds:
        raise ConfigError(
            "strategy.n_microbatches",
            m,
            f"a multiple of max(1, n_microbatches // ranks) = {rounds} with schedule=interleaved_1f1b",
            f"use a multiple of the pipeline size {ws}, e.g. strategy.n_microbatches={ws * rounds}.",
        )
    points = s.split_points
    if points and len(points) + 1 != ws * v:
        raise ConfigError(
            "strategy.split_points",
            list(points),
            f"{ws * v - 1} layer name(s) ({ws * v} stages = {ws} ranks x stages_per_rank {v})",
            "each split point starts a new stage; or set split_points=null for an even split.",
        )
    if not run.data.drop_last:
        raise ConfigError(
            "data.drop_last",
            "false",
            f"true with strategy={s.name}",
            "pipeline stages are built for one batch shape; a short last batch cannot be cut into "
            f"{m} equal micro-batches.",
        )


def check_fsdp_tp(run: Run, s: FSDPTPStrategyConfig) -> None:
    check_tp_static(run, s)
    ws, shape = run.world.size, world_shape(run)
    tp, dp = s.tp_degree, s.dp_degree
    check_divides(
        "strategy.tp_degree",
        tp,
        ws,
        shape,
        f"the mesh is (dp_degree, tp_degree) with dp_degree x tp_degree = {ws}.",
    )
    if dp != -1 and dp * tp != ws:
        raise ConfigError(
            "strategy.dp_degree",
            dp,
            f"-1 or {ws // tp} (dp_degree x tp_degree must equal the world size: {dp} x {tp} = {dp * tp}, "
            f"world size {shape})",
            f"set strategy.dp_degree=-1, or nproc_per_node={dp * tp} for a {dp} x {tp} mesh.",
        )


# ------------------------------------------------------------------------------------------ model
def _can_use(lacking: set[str]) -> str:
    return ", ".join(spec.name for spec in core.all() if not spec.needs & lacking)


def check_tp_model(run: Run, s: TPStrategyConfig, model: Any, tp: int) -> None:
    """The model has a tensor-parallel plan whose patterns select modules that its styles can split,
    that ties no split weight to another module, and heads that split over `tp` ranks."""
    from disttrain.models.parallel import TP_PLAN_KEY, class_path, pipeline_layers, tp_plan_source

    found = tp_plan_source(model, s.tp_plan)
    if found is None:
        lacking = {TP_PLAN} | (set() if pipeline_layers(model) is not None else {PIPELINE_LAYERS})
        raise ConfigError(
            "model",
            class_path(model),
            f"a model with a tensor-parallel plan for strategy={s.name}",
            f"{class_path(model)} has no tp_plan() method, no entry in disttrain.models.parallel.TP_PLANS "
            "and no Hugging Face base_model_tp_plan; write one in config, e.g. "
            "'strategy.tp_plan={layers.*.fc1: colwise, layers.*.fc2: rowwise}' (module name patterns -> "
            f"colwise, rowwise, ...), or use a strategy that needs no plan: {_can_use(lacking)}.",
        )
    source, factory = found
    plan = factory()
    key = TP_PLAN_KEY if source == TP_PLAN_KEY else "model"
    value = s.tp_plan if source == TP_PLAN_KEY else class_path(model)
    if not plan:
        raise ConfigError(
            key,
            value,
            f"a plan naming at least one module ({source})",
            "write at least one {pattern: style} entry, or use strategy=ddp or fsdp.",
        )
    _check_plan_modules(plan, source, key, value, model)
    _check_heads(model, tp)


def _check_plan_modules(plan: dict[str, Any], source: str, key: str, value: Any, model: Any) -> None:
    """Every pattern selects a module; weight-splitting styles only Linear/Embedding; no split weight
    shared with another module (it would be split once and left whole in the other: untied)."""
    from torch import nn
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from disttrain.models.parallel import plan_matches

    modules = dict(model.named_modules())
    holders: dict[int, set[str]] = {}
    for name, module in modules.items():
        for p in module.parameters(recurse=False):
            holders.setdefault(id(p), set()).add(name)
    for pattern, style in plan.items():
        matched = plan_matches(model, pattern)
        if not matched:
            raise ConfigError(
                key,
                value,
                f"module name patterns that select modules of {type(model).__name__} (in {source}: "
                f"{pattern!r} selects none)",
                "one fnmatch pattern per dotted level of child names, as parallelize_module reads "
                f"them; {_nearest(model, pattern)}.",
            )
        for name in matched:
            module = modules[name]
            splits = isinstance(style, (ColwiseParallel, RowwiseParallel))
            if splits and not isinstance(module, (nn.Linear, nn.Embedding)):
                raise ConfigError(
                    key,
                    value,
                    f"column/row-wise styles on nn.Linear or nn.Embedding modules ({source}: {pattern!r} "
                    f"selects {name}, a {type(module).__name__})",
                    "point the pattern at the Linear layers inside it (e.g. layers.*.mlp.fc1).",
                )
            shared = sorted({h for p in module.parameters() for h in holders[id(p)]} - {name})
            if splits and shared:
                raise ConfigError(
                    key,
                    value,
                    f"no split weight shared with another module ({source}: {name} shares a parameter "
                    f"with {', '.join(shared)})",
                    "a tied weight would be split in one module and stay whole in the other: untie it "
                    "(e.g. tie_word_embeddings=False) or leave both modules out of the plan.",
                )


def _nearest(model: Any, pattern: str) -> str:
    """Where a pattern stops selecting: the longest prefix that selects modules, and their children."""
    from disttrain.models.parallel import plan_matches

    parts = pattern.split(".")
    for n in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:n])
        found = plan_matches(model, prefix)
        if found:
            modules = dict(model.named_modules())
            children = sorted({c for f in found for c, _ in modules[f].named_children()})
            shown = ", ".join(found[:4]) + (", ..." if len(found) > 4 else "")
            return f"{prefix!r} selects {shown}, whose children are {', '.join(children) or '(none)'}"
    return f"the model's children are {', '.join(n for n, _ in model.named_children())}"


def _check_heads(model: Any, tp: int) -> None:
    """Attention heads (gpt's n_heads; an HF config's num_attention_heads and num_key_value_heads)
    must split evenly over the tensor-parallel ranks."""
    config = getattr(model, "config", None)
    found = {
        "model.n_heads": getattr(model, "n_heads", None),
        "model.config.num_attention_heads": getattr(config, "num_attention_heads", None),
        "model.config.num_key_value_heads": getattr(config, "num_key_value_heads", None),
    }
    for key, heads in found.items():
        if isinstance(heads, int) and heads % tp:
            raise ConfigError(
                key,
                heads,
                f"a multiple of the tensor-parallel degree {tp}",
                f"each tp rank holds {key.rsplit('.', 1)[-1]} / {tp} heads; use {tp * max(1, heads // tp)} "
                "heads, or a tensor-parallel degree that divides them.",
            )


def check_tp(run: Run, s: TPStrategyConfig, model: Any, gpus: int) -> None:
    check_tp_model(run, s, model, run.world.size)


def check_fsdp_tp_model(run: Run, s: FSDPTPStrategyConfig, model: Any, gpus: int) -> None:
    from disttrain.strategies.specs.sharded import check_contiguous

    check_tp_model(run, s, model, s.tp_degree)
    check_contiguous(s, model)


def check_pipeline_model(run: Run, s: PipelineStrategyConfig, model: Any, gpus: int) -> None:
    """The model splits into world x stages_per_rank stages that hold every parameter once."""
    from disttrain.models.parallel import class_path, pipeline_layers, shared_across_layers, stage_bounds

    layers = pipeline_layers(model)
    if layers is None:
        raise ConfigError(
            "model",
            class_path(model),
            f"a model with pipeline_layers() or an nn.Sequential, for strategy={s.name}",
            "return [(name, layer), ...] whose composition is the forward pass, or use a strategy "
            f"that needs no split: {_can_use({PIPELINE_LAYERS})}.",
        )
    covered = {id(p) for _, layer in layers for p in layer.parameters()}
    outside = [n for n, p in model.named_parameters() if id(p) not in covered]
    if outside:
        raise ConfigError(
            "model",
            class_path(model),
            "pipeline_layers() that hold every parameter of the model",
            f"parameters outside the layers would be lost: {', '.join(outside[:5])}; "
            "include their modules in pipeline_layers().",
        )
    shared = shared_across_layers(layers)
    if shared:
        raise ConfigError(
            "model",
            class_path(model),
            f"no parameter shared by two pipeline layers with strategy={s.name}",
            f"tied weights ({', '.join(shared[:3])}) would become two copies on different stages; "
            "untie them (model.tie_weights=false for gpt) or use another strategy.",
        )
    stages = run.world.size * s.stages_per_rank
    names = [n for n, _ in layers]
    try:
        bounds = stage_bounds(names, stages, s.split_points)
    except ValueError as exc:
        key = "strategy.split_points" if s.split_points else "strategy.stages_per_rank"
        raise ConfigError(
            key,
            s.split_points or s.stages_per_rank,
            f"<= {len(names)} stages, cut at layer names of {class_path(model)}: {', '.join(names)}",
            f"{exc}; use fewer ranks or stages_per_rank, or a deeper model.",
        ) from None
    _check_stages_train(s, names, [any(True for _ in layer.parameters()) for _, layer in layers], bounds)


def _check_stages_train(
    s: PipelineStrategyConfig, names: list[str], trained: list[bool], bounds: list[int]
) -> None:
    """Every rank's stages hold a parameter: a rank whose stages are all parameterless layers (the
    docs' `Sequential(Unflatten, net)` cut in two) gets an optimizer over nothing, which torch refuses
    in the ranks. With stages_per_rank > 1 a rank holds stages r, r + ranks, ... (the looped placement
    of the interleaved schedules): one of them without parameters trains beside the others."""
    stages = len(bounds) - 1
    ranks = max(1, stages // max(1, s.stages_per_rank))
    empty = [k for k in range(stages) if not any(trained[bounds[k] : bounds[k + 1]])]
    if not any(all(k in empty for k in range(r, stages, ranks)) for r in range(ranks)):
        return
    where = "; ".join(f"stage {k}: {', '.join(names[bounds[k] : bounds[k + 1]])}" for k in empty)
    with_params = [i for i, t in enumerate(trained) if t]
    if len(with_params) >= stages:  # a cut before the k-th of them gives each stage one
        cuts = [names[with_params[k * len(with_params) // stages]] for k in range(1, stages)]
        hint = f"e.g. strategy.split_points=[{','.join(cuts)}]"
    else:
        hint = (
            f"only {len(with_params)} layer(s) hold parameters ({', '.join(names[i] for i in with_params)}): "
            f"use at most {len(with_params)} stages (ranks x strategy.stages_per_rank), or make the "
            "model an nn.Sequential of its own layers so that it splits finer"
        )
    raise ConfigError(
        "strategy.split_points",
        s.split_points,
        f"a cut of the {stages} stages where each holds a layer with parameters",
        f"{where} would hold no parameters, and its optimizer would have nothing to train; {hint}.",
    )


# ------------------------------------------------------------------------------------------ plan
def _heads_split(shape: PlanShape, tp: int) -> bool:
    return shape.heads is None or shape.heads % tp == 0


def plan_tp(shape: PlanShape) -> list[PlanRow]:
    if shape.world < 2 or not _heads_split(shape, shape.world):
        return []
    note = f"tp over all {shape.world} ranks" + (" (across nodes: slow links)" if shape.nodes > 1 else "")
    return [PlanRow("tp", Layout(shape.world, tp=shape.world), "strategy=tp", 70, note)]


def plan_fsdp_tp(shape: PlanShape) -> list[PlanRow]:
    """tp inside a node and fsdp across nodes; on one node of >= 4 ranks, tp over half of them."""
    if shape.nodes > 1:
        tp, note = shape.per_node, "tp in the node, fsdp across nodes"
    elif shape.per_node >= 4:
        tp = shape.per_node // 2
        note = f"tp{tp} x fsdp{shape.world // tp}"
    else:
        return []
    if tp < 2 or not _heads_split(shape, tp):
        return []
    run = f"strategy=fsdp+tp strategy.tp_degree={tp}"
    return [PlanRow("fsdp+tp", Layout(shape.world, dp_shard=shape.world // tp, tp=tp, zero=3), run, 60, note)]


def plan_pipeline(shape: PlanShape) -> list[PlanRow]:
    """One stage per rank: needs at least as many layers as ranks."""
    if not 1 < shape.world <= shape.layers:
        return []
    note = f"{shape.world} balanced stages; stage 0 keeps ~all activations (1F1B)"
    return [PlanRow("pipeline", Layout(shape.world, pp=shape.world), "strategy=pipeline", 80, note)]


# ------------------------------------------------------------------------------------------ specs
PIPELINE = register(
    StrategySpec(
        name="pipeline",
        config=PipelineStrategyConfig,
        whole_outputs=False,
        dcp_layout=False,
        target="disttrain.strategies.pipeline:PipelineStrategy",
        amp=frozenset(),
        compile=False,
        ema=False,  # stages rename their parameters: the EMA's checkpoint names would not be the model's
        needs=frozenset({PIPELINE_LAYERS}),
        one_tensor_batches=True,
        check_static=check_pipeline,
        check_model=check_pipeline_model,
        layout=pipeline_layout,
        plan=plan_pipeline,
    )
)
TP = register(
    StrategySpec(
        name="tp",
        meta_setup=True,
        config=TPStrategyConfig,
        target="disttrain.strategies.tp:TPStrategy",
        amp=frozenset({"bf16"}),
        needs=frozenset({TP_PLAN}),
        check_static=check_tp_static,
        check_model=check_tp,
        layout=tp_layout,
        plan=plan_tp,
    )
)
FSDP_TP = register(
    StrategySpec(
        name="fsdp+tp",
        meta_setup=True,
        config=FSDPTPStrategyConfig,
        target="disttrain.strategies.tp:FSDPTPStrategy",
        amp=frozenset({"bf16"}),
        needs=frozenset({TP_PLAN}),
        check_static=check_fsdp_tp,
        check_model=check_fsdp_tp_model,
        layout=fsdp_tp_layout,
        plan=plan_fsdp_tp,
    )
)
