"""Torch-free strategy specs and their registry (see `core`); one module per family.

`from disttrain.strategies import specs` then `specs.get("ddp")`, `specs.all()`, `specs.register(...)`.
"""

from disttrain.strategies.specs.core import (
    ENTRY_POINTS,
    PIPELINE_LAYERS,
    STRATEGIES,
    TP_PLAN,
    PlanRow,
    PlanShape,
    StrategyConfig,
    StrategySpec,
    all,
    at_least,
    config_classes,
    cpu_collectives,
    data_parallel_row,
    discover,
    get,
    layout,
    names,
    of,
    rediscover,
    register,
    unregister,
)
from disttrain.strategies.specs.layout import Layout, replicas

__all__ = [
    "ENTRY_POINTS",
    "PIPELINE_LAYERS",
    "STRATEGIES",
    "TP_PLAN",
    "Layout",
    "PlanRow",
    "PlanShape",
    "StrategyConfig",
    "StrategySpec",
    "all",
    "at_least",
    "config_classes",
    "cpu_collectives",
    "data_parallel_row",
    "discover",
    "get",
    "layout",
    "names",
    "of",
    "rediscover",
    "register",
    "replicas",
    "unregister",
]
