"""Reference models; the user's own plug in through `model._target_`."""

from __future__ import annotations

import logging
from typing import Any

from disttrain.config.instantiate import build

log = logging.getLogger("disttrain")


def build_model(spec: dict[str, Any]) -> Any:
    return build(spec, "model")


def set_activation_checkpointing(model: Any, enabled: bool) -> None:
    """trainer.activation_checkpointing: the built-in models recompute each block in backward; a
    model without `set_activation_checkpointing()` trains without it, and the log says so."""
    if not enabled:
        return
    setter = getattr(model, "set_activation_checkpointing", None)
    if setter is None:
        log.warning(
            "trainer.activation_checkpointing=true is ignored: %s has no set_activation_checkpointing()",
            type(model).__name__,
        )
        return
    setter(True)
