"""A config's fingerprint: dotted keys (flatten), a hash, and the keys two configs differ in.

One set of rules for every caller (torch-free): a checkpoint records the hash of the keys that
shape training and resume names what changed; the nodes of a multi-node run compare theirs before
the rendezvous; `disttrain show`/`compare` list differences. Nested dicts flatten to dotted keys;
an empty dict stays a value (so a key that gains entries shows as changed); lists are values.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any

ABSENT = "<absent>"

# Keys that do not change what the run computes: logging, checkpointing, launching, naming.
NOT_SHAPING = (
    "name",
    "resume",
    "checkpoint",
    "launcher",
    "plan",
    "threads_per_rank",
    "master_addr",
    "master_port",
    "node_rank",
    "backend.timeout",
    "trainer.progress",
    "trainer.log_every",
    "trainer.val_every",
    "trainer.ckpt_every",
    "data.num_workers",
    "data.pin_memory",
    "observe",  # where metrics go (sinks) does not change training
    "storage_options",  # how to reach a store (and its keys: never into a checkpoint's meta.json)
)


def _skipped(key: str, skip: Iterable[str]) -> bool:
    return any(key == n or key.startswith(n + ".") for n in skip)


def flatten(node: Any, skip: Iterable[str] = (), prefix: str = "") -> dict[str, Any]:
    """{"trainer.max_epochs": 2, ...}; keys in `skip` (and everything under them) left out."""
    if isinstance(node, dict) and (node or not prefix):
        out: dict[str, Any] = {}
        for k, v in node.items():
            name = f"{prefix}.{k}" if prefix else str(k)
            if not _skipped(name, skip):
                out.update(flatten(v, skip, name))
        return out
    return {prefix: node}


def shaping_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The flattened config minus keys that do not shape training (NOT_SHAPING)."""
    return flatten(cfg, NOT_SHAPING)


def digest(flat: dict[str, Any]) -> str:
    """sha256 (hex) of a flattened config, independent of key order."""
    return hashlib.sha256(json.dumps(flat, sort_keys=True, default=str).encode()).hexdigest()


def config_hash(cfg: dict[str, Any]) -> str:
    """16 hex digits over the keys that shape training: what a checkpoint records."""
    return digest(shaping_config(cfg))[:16]


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, a's value, b's value) for every key of two flattened configs that differs; a key
    only one of them has shows ABSENT on the other side."""
    keys = sorted(set(a) | set(b))
    return [(k, a.get(k, ABSENT), b.get(k, ABSENT)) for k in keys if a.get(k, ABSENT) != b.get(k, ABSENT)]


def config_diff(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """'key: old -> new' for every key that differs between two flattened configs."""
    return [f"{k}: {old!r} -> {new!r}" for k, old, new in differences(saved, now)]
