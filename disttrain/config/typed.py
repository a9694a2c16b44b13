"""Typed config at runtime: a resolved plain dict slice -> the schema's dataclass instance.

The parent resolves once and freezes plain YAML (`config.yaml`); a rank reads it back and hands
each consumer the typed object of its slice (`typed(TrainerConfig, cfg["trainer"])`), so code
reads attributes (`trainer.batch_size`) and the dataclass is the only home of every default.
OmegaConf does the work: the structured merge type-checks and fills defaults, `to_object` builds
the dataclass. Unknown keys fail the merge (struct mode) unless the schema node is open. A Run's
read-only containers go to OmegaConf as copies (plain dicts and lists: it takes no subclasses).
"""

from __future__ import annotations

import copy
from dataclasses import fields, is_dataclass
from typing import Any, TypeVar

from omegaconf import OmegaConf

T = TypeVar("T")


def typed(cls: type[T], node: Any, key: str = "") -> T:
    """`node` (a dict, DictConfig or already an instance of `cls`) as an instance of `cls`.

    A value the schema refuses (a wrong type, a closed choice's stranger: a hand-edited config.yaml)
    is the ConfigError naming it as `key.<its key>`."""
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(node, cls):
        return node
    try:
        merged = OmegaConf.merge(_schema(cls), copy.deepcopy(node) if node is not None else {})
        obj = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        from disttrain.config.errors import translate

        inner = getattr(exc, "full_key", None)
        exc.full_key = ".".join(str(part) for part in (key, inner) if part)
        err = translate(exc, [])
        if err is None:
            raise
        raise err from None
    if not isinstance(obj, cls):  # a schema node with init=False (a keyword field) comes back as is
        raise TypeError(f"{cls.__name__}: OmegaConf returned {type(obj).__name__}")
    check_at_least(obj, key)
    return obj


def check_at_least(obj: Any, key: str) -> None:
    """Each field declared with `at_least=N` (config.common.help_field), nested blocks' too, holds
    null or a number >= N: else the ConfigError naming it, its help text the hint."""
    for f in fields(obj):
        value, name, low = getattr(obj, f.name), f"{key}.{f.name}".lstrip("."), f.metadata.get("at_least")
        if is_dataclass(value):
            check_at_least(value, name)
        if low is not None and value is not None and value < low:
            from disttrain.config.errors import ConfigError

            raise ConfigError(name, value, f"a number >= {low:g}", f"{name}: {f.metadata['help']}.")


_SCHEMAS: dict[type, Any] = {}


def _schema(cls: type) -> Any:
    """`cls` as an OmegaConf structured config, built once per class (~half of a `typed` call):
    `merge` copies it, so the cached node is never changed."""
    node = _SCHEMAS.get(cls)
    if node is None:
        node = _SCHEMAS[cls] = OmegaConf.structured(cls)
    return node


__all__ = ["check_at_least", "typed"]
