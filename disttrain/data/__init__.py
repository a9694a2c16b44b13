"""Data sets: built-in ones and the user's own through `data.train._target_`."""

from __future__ import annotations

from typing import Any

from disttrain.config.instantiate import build


def build_datasets(data: dict[str, Any]) -> tuple[Any, Any | None]:
    """(train, val) Datasets from the data group; val is None when `data.val` is null."""
    train = build(data["train"], "data.train")
    val = build(data["val"], "data.val") if data.get("val") else None
    return train, val
