"""Strategies: how a model is parallelised. The torch-free specs (`strategies/specs/`) name them;
the class of a strategy is imported only when a rank builds it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from disttrain.config.schema import AmpConfig
    from disttrain.dist import DistEnv
    from disttrain.strategies.base import Strategy


def build_strategy(
    cfg: dict[str, Any], env: DistEnv, amp: AmpConfig | dict[str, Any] | None = None
) -> Strategy:
    """The strategy of a resolved `strategy` slice, given its typed config (the spec's dataclass)
    and the run's mixed precision (`amp`; None: off), both fixed at construction."""
    from disttrain.config.schema import AmpConfig
    from disttrain.config.typed import typed
    from disttrain.strategies import specs

    spec = specs.get(cfg["name"])
    strategy: Strategy = spec.load()(spec.typed(cfg), env, typed(AmpConfig, amp) if amp else None)
    return strategy
