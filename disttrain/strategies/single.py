"""One process, one device: the reference every other strategy is checked against."""

from __future__ import annotations

from disttrain.strategies.base import Strategy


class SingleStrategy(Strategy):
    """The base class's defaults: the model on this rank's device, no wrapper."""
