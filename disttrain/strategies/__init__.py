"""Strategies: how a model is parallelised. The torch-free specs (`strategies/specs/`) name them;
the class of a strategy is imported only when a rank builds it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from disttrain.config.schema import AmpConfig
    from disttrain.dist import DistEnv
    from disttrain.strategies.base import Strategy
    from disttrain.strategies.specs import StrategyConfig


def build_strategy(
    strategy: StrategyConfig | Mapping[str, Any],
    env: DistEnv,
    amp: AmpConfig | Mapping[str, Any] | None = None,
) -> Strategy:
    """The strategy of a run's typed strategy config (`run.strategy`: the spec's dataclass; a plain
    `strategy` slice is typed through its spec) and the run's mixed precision (`amp`; None: off),
    both fixed at construction."""
    from disttrain.config.schema import AmpConfig
    from disttrain.config.typed import typed
    from disttrain.strategies import specs

    spec = specs.get(strategy["name"] if isinstance(strategy, Mapping) else strategy.name)
    built: Strategy = spec.load()(spec.typed(strategy), env, typed(AmpConfig, amp) if amp else None)
    return built
