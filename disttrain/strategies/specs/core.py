"""`StrategySpec` and the registry: everything disttrain knows about a strategy before torch loads.

One spec per strategy names its typed config (the only home of its defaults), its pre-launch checks,
its data-parallel degree, the mixed precision it supports, its rows in `disttrain plan` and the
class that runs it (imported lazily). The schema (`base_<name>` nodes), the checks, `build_strategy`
and the planner iterate this registry; nothing else compares strategy names.

Built-in specs live in this package, one module per family; the registry is `STRATEGIES`, a
`disttrain.config.registry.Registry` like every plug-in kind's: a package of yours adds a strategy
with an entry point in the `disttrain.strategies` group (a module that calls `register`, or a spec
object), or by calling `register` before the config is composed (tests, notebooks).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from omegaconf import MISSING

from disttrain.config.common import Block, help_field
from disttrain.config.errors import ConfigError
from disttrain.config.registry import Registry, config_nodes

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


def layout(
    name: str,
    shape: PlanShape,
    *,
    preference: int,
    run: str,
    note: str,
    tp: int = 1,
    pp: int = 1,
    zero: int = 0,
    shard: int = 1,
) -> dict[str, Any]:
    """One row of `disttrain plan`: degrees dp x tp x pp = world, the ZeRO stage of the dp dimension
    and how many ranks share it (`shard`); `run` is the overrides that train this layout, and a lower
    `preference` is chosen first among the layouts that fit (less communication, less code)."""
    return {
        "layout": name,
        "run": run,
        "dp": shape.world // (tp * pp),
        "tp": tp,
        "pp": pp,
        "zero": zero,
        "shard": shard,
        "preference": preference,
        "note": note,
    }


def data_parallel_row(
    name: str, shape: PlanShape, *, preference: int, note: str, zero: int = 0
) -> dict[str, Any]:
    """The row of a data-parallel strategy run as is (`strategy=<name>`) over every rank: replicated
    (zero=0), or its ZeRO stage sharded across the whole world."""
    shard = shape.world if zero else 1
    return layout(
        name, shape, preference=preference, run=f"strategy={name}", zero=zero, shard=shard, note=note
    )


def _whole_world(s: Any, world: int) -> int:
    return world


def _never(s: Any) -> bool:
    return False


StaticCheck = Callable[["Run", Any], None]
ModelCheck = Callable[["Run", Any, Any, int], None]


@dataclass(frozen=True)
class StrategySpec:
    """What disttrain knows about one strategy, without importing torch.

    check_static(run, s): pre-launch rules on the run (`disttrain.config.run.Run`) and its typed
    strategy slice `s` (`run.strategy`).
    check_model(run, s, meta_model, gpus): rules that need the model (built on the meta device).
    dp_degree(s, world): data-parallel replicas (ranks that read different data) at `world` ranks;
    the strategy's `data_parallel_rank_size()` returns the same size.
    cpu_collectives(s): its ranks run collectives on CPU tensors with this config (FSDP's
    cpu_offload: gradient norms and full state dicts of CPU shards); on GPUs the process group then
    needs gloo for CPU next to NCCL (`group_backend`).
    """

    name: str
    config_cls: type[StrategyConfig]
    impl: str  # "package.module:Class", imported only when a rank builds the strategy
    about: str  # one line: what it does (docs, listings)
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
    dp_degree: Callable[[Any, int], int] = _whole_world
    cpu_collectives: Callable[[Any], bool] = _never
    plan: Callable[[PlanShape], list[dict[str, Any]]] | None = None

    def __post_init__(self) -> None:
        default = {f.name: f.default for f in dataclasses.fields(self.config_cls)}.get("name")
        if default != self.name:
            raise ValueError(f"spec {self.name!r}: {self.config_cls.__name__}.name defaults to {default!r}")
        if ":" not in self.impl:
            raise ValueError(f"spec {self.name!r}: impl {self.impl!r} is not 'module:Class'")
        if not self.amp <= AMP_MODES:
            raise ValueError(f"spec {self.name!r}: amp {sorted(self.amp)} not within {sorted(AMP_MODES)}")

    def load(self) -> type:
        """The strategy class (imports torch)."""
        module, _, cls = self.impl.partition(":")
        loaded: type = getattr(importlib.import_module(module), cls)
        return loaded

    def typed(self, node: Any) -> Any:
        """The `strategy` slice of a resolved config as this spec's config dataclass."""
        from disttrain.config.typed import typed

        return typed(self.config_cls, node)


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
    describe=lambda spec: spec.impl,
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
            f"the keys of {spec.config_cls.__name__} ({', '.join(f.name for f in dataclasses.fields(spec.config_cls))})",
            f"choose a strategy with its group option (strategy={name}), not by setting strategy.name "
            f"on another option's keys ({type(exc).__name__}).",
        ) from None


def dp_degree(run: Run) -> int:
    """Data-parallel replicas of a run: the spec's answer at its world size."""
    return int(get(run.strategy.name).dp_degree(run.strategy, run.world.size))


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
