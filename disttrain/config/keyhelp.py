"""Every config key with its type, default and the schema's help text (dataclass field metadata
`help`): what `disttrain config --help` and `disttrain train --help` list. No torch import."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from omegaconf import DictConfig, OmegaConf


def _type_name(tp: Any) -> str:
    name = tp if isinstance(tp, str) else getattr(tp, "__name__", repr(tp))
    return str(name).replace("typing.", "")


def _show(value: Any) -> str:
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def key_rows(cfg: DictConfig, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(key, type, default, help) for each leaf of the composed config, following the schemas."""
    rows: list[tuple[str, str, str, str]] = []
    schema = OmegaConf.get_type(cfg)
    fields = {f.name: f for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else {}
    for key in cfg:
        name = f"{prefix}{key!s}"
        f = fields.get(str(key))
        text = str(f.metadata.get("help", "")) if f is not None else ""
        node = cfg._get_node(str(key))
        if isinstance(node, DictConfig) and not OmegaConf.is_missing(cfg, str(key)):
            if text:
                rows.append((name, "group", "", text))
            rows.extend(key_rows(node, f"{name}."))
            continue
        value = OmegaConf.to_container(node) if OmegaConf.is_list(node) else node._value()  # type: ignore[union-attr]
        shown = "???" if OmegaConf.is_missing(cfg, str(key)) else _show(value)
        rows.append((name, _type_name(f.type) if f is not None else type(value).__name__, shown, text))
    return rows


def format_keys(cfg: DictConfig) -> str:
    """A plain table: key, type, default (with the chosen group options and overrides), help."""
    rows = key_rows(cfg)
    width = max(len(r[0]) for r in rows) + 2
    tw = max(len(r[1]) for r in rows) + 2
    lines = ["== Config keys (type, default with these overrides, help) ==", ""]
    for key, tp, default, text in rows:
        default = default if len(default) <= 40 else default[:37] + "..."
        lines.append(f"{key:<{width}}{tp:<{tw}}{default:<42}{text}".rstrip())
    return "\n".join(lines) + "\n"
