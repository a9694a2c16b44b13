"""`StrategySpec` and the registry: everything disttrain knows about a strategy before torch loads.

One spec per strategy names its typed config (the only home of its defaults), its pre-launch checks,
its parallel layout (`Layout`: degrees and meshes), the mixed precision it supports, its rows in `disttrain plan` and the
class that runs it (imported lazily). The schema (`base_<name>` nodes), the checks, `build_strategy`
and the planner iterate this registry; nothing else compares strategy names.

Built-in specs live in this package, one module per family; the registry is `STRATEGIES`, a
`disttrain.config.registry.Registry` like every plug-in kind's: a package of yours adds a strategy
with an entry point in the `disttrain.strategies` group (a module that calls `register`, or a spec
object), or by calling `register` before the config is composed (tests, notebooks).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from omegaconf import MISSING

from disttrain.config.common import Block, help_field
from disttrain.config.errors import ConfigError
from disttrain.config.registry import Registry, Spec, config_nodes
from disttrain.strategies.specs.layout import Layout, replicas

if TYPE_CHECKING:
    from disttrain.config.run import Run

AMP_MODES = frozenset({"bf16", "fp16", "fp8"})
# Model abilities a strategy may need (see disttrain.models.parallel).
TP_PLAN, PIPELINE_LAYERS = "tp_plan", "pipeline_layers"


@dataclass
class StrategyConfig(Block):
    """Base of every strategy's config dataclass; `name` defaults to the spec's name."""

    name: str = help_field("how the model is parallelised", MISSING)


@dataclass(frozen=True)
class PlanShape:
    """What a plan layout depends on: the world and the model's depth and heads."""

    world: int
    per_node: int
    nodes: int
    layers: int
    heads: int | None


@dataclass(frozen=True)
class PlanRow:
    """One row of `disttrain plan`: a layout, `run` (the overrides that train it) and a `preference`
    (lower is chosen first among the rows that fit: less communication, less code)."""

    name: str
    layout: Layout
    run: str
    preference: int
    note: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "layout": self.name,
            "run": self.run,
            **self.layout.degrees(),
            "preference": self.preference,
            "note": self.note,
        }


def data_parallel_row(name: str, shape: PlanShape, *, preference: int, note: str, zero: int = 0) -> PlanRow:
    """The row of a data-parallel strategy run as is (`strategy=<name>`) over every rank: replicated
    (zero=0), or its ZeRO stage sharded across the whole world."""
    w = shape.world
    layout = Layout(w, dp_shard=w, zero=zero) if zero else replicas(None, w)
    return PlanRow(name, layout, f"strategy={name}", preference, note)


def _never(s: Any) -> bool:
    return False


StaticCheck = Callable[["Run", Any], None]
ModelCheck = Callable[["Run", Any, Any, int], None]


@dataclass(frozen=True)
class StrategySpec(Spec):
    """What disttrain knows about one strategy, without importing torch: a `Spec` (`config`: a
    `StrategyConfig`; `target`: its `Strategy` class, imported only when a rank builds it), and:

    check_static(run, s): pre-launch rules on the run (`disttrain.config.run.Run`) and its typed
    strategy slice `s` (`run.strategy`).
    check_model(run, s, meta_model, gpus): rules that need the model (built on the meta device).
    layout(s, world): the run's `Layout` at `world` ranks (its degrees and ZeRO stage); the strategy
    builds its mesh from it and `plan`, `plan --simulate` and checkpoints read it.
    cpu_collectives(s): its ranks run collectives on CPU tensors with this config (FSDP's
    cpu_offload: gradient norms and full state dicts of CPU shards); on GPUs the process group then
    needs gloo for CPU next to NCCL (`group_backend`).
    """

    amp: frozenset[str] = AMP_MODES  # mixed precision modes besides off
    replicated: bool = False  # every rank holds the whole, identical model (debug.check_sync_every)
    # setup_module shards a meta-device model in place, leaving it on meta: with init.path filling
    # every tensor, the ranks build the model there and no rank ever holds it whole (init_from.build)
    meta_setup: bool = False
    compile: bool = True  # trainer.compile works with it
    # trainer.oom=auto_microbatch can retry a step after an out-of-memory error: no collective runs
    # inside forward/backward, so a rank that fails there leaves no peer waiting in one.
    oom_retry: bool = False
    ema: bool = True  # trainer.ema works with it (every rank holds whole or sharded parameters)
    # peft=lora works with it: PEFT's LoRA layers wrapped (or replicated) whole, frozen base and all,
    # and its state dict is DCP's (the frozen parameters left out); tp and pipeline split the layers
    peft: bool = False
    needs: frozenset[str] = frozenset()  # model abilities: TP_PLAN, PIPELINE_LAYERS
    one_tensor_batches: bool = False  # stages pass one tensor: model(inputs), one target (pipeline)
    whole_outputs: bool = True  # every rank computes the model's whole output of its batch (predict)
    # its state_dict is DCP's get_state_dict layout (model and optimizer under their module names):
    # plan --simulate --load-at plans its save and load; the rest keep a format of their own
    dcp_layout: bool = True
    check_static: StaticCheck | None = None
    check_model: ModelCheck | None = None
    layout: Callable[[Any, int], Layout] = replicas
    cpu_collectives: Callable[[Any], bool] = _never
    plan: Callable[[PlanShape], list[PlanRow]] | None = None

    def __post_init__(self) -> None:
        self.check_named("strategy")
        if not self.amp <= AMP_MODES:
            raise ValueError(f"spec {self.name!r}: amp {sorted(self.amp)} not within {sorted(AMP_MODES)}")


STRATEGIES: Registry[StrategySpec] = Registry(
    "strategies",
    key="strategy.name",
    spec_type=StrategySpec,
    builtin=(
        "disttrain.strategies.specs.data_parallel",
        "disttrain.strategies.specs.sharded",
        "disttrain.strategies.specs.model_parallel",
    ),
    hint="choose the strategy group option: strategy=ddp.",
    describe=lambda spec: spec.target,
)
ENTRY_POINTS = STRATEGIES.group
# The registry's contract under the names the strategies' callers use.
register, unregister, discover = STRATEGIES.register, STRATEGIES.unregister, STRATEGIES.discover
rediscover, all, names, get = STRATEGIES.rediscover, STRATEGIES.all, STRATEGIES.names, STRATEGIES.get


def of(cfg: Run | Mapping[str, Any]) -> tuple[StrategySpec, Any]:
    """(spec, typed strategy config) of a run, or of a resolved config's plain form before its Run
    exists (the check that builds the Run: ConfigError if its keys are another strategy's)."""
    from disttrain.config.run import Run

    if isinstance(cfg, Run):
        return get(cfg.strategy.name), cfg.strategy
    name: Any = (cfg.get("strategy") or {}).get("name")
    spec = get(name)
    try:
        return spec, spec.typed(cfg["strategy"])
    except Exception as exc:
        raise ConfigError(
            "strategy.name",
            name,
            f"the keys of {spec.config.__name__} ({', '.join(f.name for f in dataclasses.fields(spec.config))})",
            f"choose a strategy with its group option (strategy={name}), not by setting strategy.name "
            f"on another option's keys ({type(exc).__name__}).",
        ) from None


def layout(run: Run, world: int | None = None) -> Layout:
    """The run's parallel layout, from its spec, at its world size (or `world`: elastic membership
    may differ from the config's nodes x nproc_per_node)."""
    return get(run.strategy.name).layout(run.strategy, run.world.size if world is None else world)


def cpu_collectives(run: Run) -> bool:
    """Whether the ranks of a run run collectives on CPU tensors (the spec says)."""
    return bool(get(run.strategy.name).cpu_collectives(run.strategy))


def at_least(key: str, value: Any, low: int, hint: str) -> int:
    """`strategy.<key>` must be an integer >= low."""
    if value is None or value < low:
        raise ConfigError(f"strategy.{key}", value, f"an integer >= {low}", hint)
    return int(value)


def config_classes() -> dict[str, type]:
    """ConfigStore node name -> dataclass: `base_<name>` for every spec."""
    return config_nodes(STRATEGIES)
