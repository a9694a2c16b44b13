"""Strategies: how a model is parallelised. The torch-free specs (`strategies/specs/`) name them;
the class of a strategy is imported only when a rank builds it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from disttrain.dist import DistEnv
    from disttrain.strategies.base import Strategy


def build_strategy(cfg: dict[str, Any], env: DistEnv) -> Strategy:
    """The strategy of a resolved `strategy` slice, given its typed config (the spec's dataclass)."""
    from disttrain.strategies import specs

    spec = specs.get(cfg["name"])
    strategy: Strategy = spec.load()(spec.typed(cfg), env)
    return strategy
