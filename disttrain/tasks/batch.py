"""Batches of any structure (tensors, tuples of any length, dicts, nested containers), via pytree.

A *field* names one part of a batch: for a tuple or list batch `x` is item 0 and `y` item 1 (or any
index, `2`); for a dict batch it is the key; dots walk nested containers (`inputs.image`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

POSITIONAL = {"x": 0, "y": 1}


def to_device(batch: Any, device: torch.device) -> Any:
    """Every tensor in the batch moved to `device` (other leaves as they are)."""
    return pytree.tree_map_only(torch.Tensor, lambda t: t.to(device, non_blocking=True), batch)


def tensors(batch: Any) -> list[torch.Tensor]:
    return [leaf for leaf in pytree.tree_leaves(batch) if isinstance(leaf, torch.Tensor)]


def leading_size(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor with one (0 when it has none)."""
    for t in tensors(batch):
        if t.dim() > 0:
            return int(t.shape[0])
    return 0


def split(batch: Any, parts: int) -> list[Any]:
    """`parts` consecutive pieces along the first dimension of every tensor (the last may be smaller).

    trainer.oom=auto_microbatch uses this: the same samples, cut finer.
    """
    size = -(-leading_size(batch) // parts)
    leaves, spec = pytree.tree_flatten(batch)
    pieces = [
        leaf.split(size) if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 else None for leaf in leaves
    ]
    count = max((len(p) for p in pieces if p is not None), default=1)
    return [
        pytree.tree_unflatten(
            [leaf if p is None else p[i] for leaf, p in zip(leaves, pieces, strict=True)], spec
        )
        for i in range(count)
    ]


def describe(batch: Any) -> str:
    """A short structure-and-shapes text for messages: `(x: [2, 64] float32, y: [2] int64)`."""
    if isinstance(batch, torch.Tensor):
        return f"tensor {list(batch.shape)} {str(batch.dtype).removeprefix('torch.')}"
    if isinstance(batch, Mapping):
        return "{" + ", ".join(f"{k!r}: {describe(v)}" for k, v in batch.items()) + "}"
    if isinstance(batch, (tuple, list)):
        return f"{len(batch)} items (" + ", ".join(describe(v) for v in batch) + ")"
    return type(batch).__name__


def field(batch: Any, name: str | int) -> Any:
    """The part of `batch` that `name` names (see the module docstring); KeyError says what exists."""
    value = batch
    for part in str(name).split("."):
        value = _one(value, part, name, batch)
    return value


def _one(value: Any, part: str, name: str | int, batch: Any) -> Any:
    if isinstance(value, Mapping):
        if part in value:
            return value[part]
        raise KeyError(
            f"the batch has no field {name!r}: it is {describe(batch)}; its keys are {list(value)}"
        )
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        index = POSITIONAL.get(part, int(part) if part.lstrip("-").isdigit() else None)
        if index is None or not -len(value) <= index < len(value):
            raise KeyError(
                f"the batch has no field {name!r}: it is {describe(batch)} "
                f"(fields: x = item 0, y = item 1, or an index 0..{len(value) - 1})"
            )
        return value[index]
    raise KeyError(f"the batch has no field {name!r}: it is {describe(batch)}")
