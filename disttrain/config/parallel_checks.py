"""Pre-launch checks for the model-parallel strategies (pipeline, tp, fsdp+tp), with the numbers.

`check_static` needs only the resolved config (no torch); `check_model` looks at the model built
on the meta device. Both raise ConfigError; validate.py calls them.
"""

from __future__ import annotations

from typing import Any

from disttrain.config.errors import ConfigError, check_divides, one_of

PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
NEEDS_TP_PLAN = ("tp", "fsdp+tp")


def _world(cfg: dict[str, Any]) -> tuple[int, str]:
    ws = int(cfg["nodes"]) * int(cfg["nproc_per_node"])
    return ws, f"nodes x nproc_per_node = {cfg['nodes']} x {cfg['nproc_per_node']} = {ws}"


def check_static(cfg: dict[str, Any]) -> None:
    name = cfg["strategy"]["name"]
    if name not in ("pipeline", *NEEDS_TP_PLAN):
        return
    ws, shape = _world(cfg)
    if ws < 2:
        raise ConfigError(
            "nproc_per_node",
            cfg["nproc_per_node"],
            f">= 2 ranks with strategy={name} (world size is {shape})",
            f"{name} splits one model across ranks: set nproc_per_node=2 (CPU ranks work), "
            "or use strategy=single on one rank.",
        )
    if name == "pipeline":
        _check_pipeline(cfg, ws)
    elif name == "fsdp+tp":
        _check_2d(cfg, ws, shape)


def _check_pipeline(cfg: dict[str, Any], ws: int) -> None:
    s = cfg["strategy"]
    schedule, m, v, batch = (
        s["schedule"],
        s["n_microbatches"],
        s["stages_per_rank"],
        cfg["trainer"]["batch_size"],
    )
    if schedule not in PIPELINE_SCHEDULES:
        raise ConfigError(
            "strategy.schedule", schedule, one_of(PIPELINE_SCHEDULES), "1f1b holds the fewest activations."
        )
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
    points = s.get("split_points")
    if points and len(points) + 1 != ws * v:
        raise ConfigError(
            "strategy.split_points",
            list(points),
            f"{ws * v - 1} layer name(s) ({ws * v} stages = {ws} ranks x stages_per_rank {v})",
            "each split point starts a new stage; or set split_points=null for an even split.",
        )
    if not cfg["data"].get("drop_last", True):
        raise ConfigError(
            "data.drop_last",
            "false",
            "true with strategy=pipeline",
            "pipeline stages are built for one batch shape; a short last batch cannot be cut into "
            f"{m} equal micro-batches.",
        )


def _check_2d(cfg: dict[str, Any], ws: int, shape: str) -> None:
    tp, dp = cfg["strategy"]["tp_degree"], cfg["strategy"]["dp_degree"]
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


def check_model(cfg: dict[str, Any], model: Any) -> None:
    """Checks that need the model (built on the meta device): it can be split as configured."""
    from disttrain.models.parallel import (
        class_path,
        pipeline_layers,
        shared_across_layers,
        stage_bounds,
        tp_plan_fn,
    )
    from disttrain.strategies import STRATEGIES

    name = cfg["strategy"]["name"]
    if name in NEEDS_TP_PLAN:
        factory = tp_plan_fn(model)
        if factory is None:
            unsplittable = () if pipeline_layers(model) is not None else ("pipeline",)
            others = [s for s in STRATEGIES if s not in (*NEEDS_TP_PLAN, *unsplittable)]
            raise ConfigError(
                "model",
                class_path(model),
                f"a model with a tensor-parallel plan for strategy={name}",
                f"{class_path(model)} has no tp_plan() method and no entry in "
                "disttrain.models.parallel.TP_PLANS; give it one (module name -> ColwiseParallel/"
                f"RowwiseParallel), or use a strategy that needs no plan: {', '.join(others)}.",
            )
        modules = {n for n, _ in model.named_modules()}
        unknown = sorted(set(factory()) - modules)
        if unknown:
            raise ConfigError(
                "model",
                class_path(model),
                f"a tp plan naming modules of the model (unknown: {', '.join(unknown)})",
                "plan keys are module names as in model.named_modules().",
            )
        _check_heads(cfg, model, name)
    if name == "pipeline":
        layers = pipeline_layers(model)
        if layers is None:
            others = [s for s in STRATEGIES if s != "pipeline"]
            raise ConfigError(
                "model",
                class_path(model),
                "a model with pipeline_layers() or an nn.Sequential, for strategy=pipeline",
                "return [(name, layer), ...] whose composition is the forward pass, or use a strategy "
                f"that needs no split: {', '.join(others)}.",
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
                "no parameter shared by two pipeline layers with strategy=pipeline",
                f"tied weights ({', '.join(shared[:3])}) would become two copies on different stages; "
                "untie them (model.tie_weights=false for gpt) or use another strategy.",
            )
        s = cfg["strategy"]
        stages = int(cfg["nodes"]) * int(cfg["nproc_per_node"]) * s["stages_per_rank"]
        names = [n for n, _ in layers]
        try:
            stage_bounds(names, stages, s.get("split_points"))
        except ValueError as exc:
            key = "strategy.split_points" if s.get("split_points") else "strategy.stages_per_rank"
            raise ConfigError(
                key,
                s.get("split_points") or s["stages_per_rank"],
                f"<= {len(names)} stages, cut at layer names of {class_path(model)}: {', '.join(names)}",
                f"{exc}; use fewer ranks or stages_per_rank, or a deeper model.",
            ) from None


def _check_heads(cfg: dict[str, Any], model: Any, name: str) -> None:
    """A transformer's heads are split across the tp ranks: n_heads must divide evenly."""
    heads = getattr(model, "n_heads", None)
    if heads is None:
        return
    ws, _ = _world(cfg)
    tp = ws if name == "tp" else int(cfg["strategy"]["tp_degree"])
    if heads % tp:
        raise ConfigError(
            "model.n_heads",
            heads,
            f"a multiple of the tensor-parallel degree {tp}",
            f"each tp rank holds n_heads / {tp} heads; set model.n_heads={tp * max(1, heads // tp)}.",
        )
