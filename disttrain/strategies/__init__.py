"""Strategies: how a model is parallelised. Names map to classes lazily (no torch import here)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from disttrain.dist import DistEnv
    from disttrain.strategies.base import Strategy

STRATEGIES: dict[str, str] = {
    "single": "disttrain.strategies.single:SingleStrategy",
    "ddp": "disttrain.strategies.ddp:DDPStrategy",
    "dp": "disttrain.strategies.dp:DPStrategy",
    "fsdp": "disttrain.strategies.fsdp:FSDPStrategy",
    "zero": "disttrain.strategies.zero:ZeroStrategy",
    "localsgd": "disttrain.strategies.localsgd:LocalSGDStrategy",
    "pipeline": "disttrain.strategies.pipeline:PipelineStrategy",
    "tp": "disttrain.strategies.tp:TPStrategy",
    "fsdp+tp": "disttrain.strategies.tp:FSDPTPStrategy",
}


def build_strategy(cfg: dict[str, Any], env: DistEnv) -> Strategy:
    module, _, cls = STRATEGIES[cfg["name"]].partition(":")
    strategy: Strategy = getattr(importlib.import_module(module), cls)(cfg, env)
    return strategy
