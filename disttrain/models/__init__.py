"""Reference models; the user's own plug in through `model._target_`."""

from __future__ import annotations

from typing import Any

from disttrain.config.instantiate import build


def build_model(spec: dict[str, Any]) -> Any:
    return build(spec, "model")
