"""Every config key with its type, default and the schema's help text (dataclass field metadata
`help`): what `disttrain config --help` and `disttrain train --help` list. No torch import."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from omegaconf import DictConfig, EnumNode, OmegaConf


def _type_name(tp: Any) -> str:
    name = tp if isinstance(tp, str) else getattr(tp, "__name__", repr(tp))
    return str(name).replace("typing.", "")


def _show(value: Any) -> str:
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


# Hydra's keys of a `_target_` node, and what they do there
TARGET_KEYS = {
    "_target_": "what this node builds: a dotted path to a class or function (yours: mylab.mod.Name)",
    "_partial_": "built as a partial: disttrain calls it later with what only the run has (e.g. the "
    "model's parameters)",
    "_recursive_": "whether nested _target_ nodes are built first (false: passed on as config)",
    "_args_": "positional arguments of the _target_",
}


def _help(schema: Any, key: str) -> tuple[Any, str]:
    """The schema's field for `key` and its help text: a subclass that only changes a default (the
    option's `lr: float = 0.05`) keeps the help its base class gives the key."""
    bases = [c for c in getattr(schema, "__mro__", ()) if dataclasses.is_dataclass(c)]
    found = [c.__dataclass_fields__[key] for c in bases if key in c.__dataclass_fields__]
    text = next((str(f.metadata["help"]) for f in found if f.metadata.get("help")), "")
    return (found[0] if found else None), text


def _argument_help(key: str, value: Any, target: Any) -> str:
    """A key of a `_target_` node without a schema: an argument of that class or function."""
    if key in TARGET_KEYS:
        return TARGET_KEYS[key]
    follows = f"; follows {value[2:-1]}" if isinstance(value, str) and value.startswith("${") else ""
    return f"argument {key} of {target}{follows}"


def key_rows(cfg: DictConfig, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(key, type, default, help) for each leaf of the composed config, following the schemas; the
    keys of a `_target_` node that no schema describes are its target's arguments."""
    rows: list[tuple[str, str, str, str]] = []
    schema = OmegaConf.get_type(cfg)
    target = cfg._get_node("_target_")._value() if "_target_" in cfg else None  # type: ignore[union-attr]
    for key in cfg:
        name = f"{prefix}{key!s}"
        f, text = _help(schema, str(key))
        node = cfg._get_node(str(key))
        if not text and target is not None:
            text = _argument_help(str(key), node._value(), target)  # type: ignore[union-attr]
        if isinstance(node, DictConfig) and not OmegaConf.is_missing(cfg, str(key)):
            if text:
                rows.append((name, "group", "", text))
            rows.extend(key_rows(node, f"{name}."))
            continue
        value = OmegaConf.to_container(node) if OmegaConf.is_list(node) else node._value()  # type: ignore[union-attr]
        shown = "???" if OmegaConf.is_missing(cfg, str(key)) else _show(value)
        kind = _type_name(f.type) if f is not None else type(value).__name__
        if isinstance(node, EnumNode):  # a closed choice: its members (null first where allowed)
            members = [str(m.value) for m in node.enum_type]
            kind = "|".join(["null", *members] if node._is_optional() else members)
        elif f is not None and f.metadata.get("choices"):  # a Switch (an Any field read as one)
            kind = "|".join(str(m.value) for m in f.metadata["choices"])
        rows.append((name, kind, shown, text))
    return rows


WIDTH = 100  # columns of the help page: an 80-100 column terminal shows it without wrapping mid-word
INDENT = "    "


def format_keys(cfg: DictConfig, width: int = WIDTH) -> str:
    """Each key as its override with the default (`trainer.max_steps=-1  (int)`, the group options
    and overrides chosen), then its help, indented and wrapped to `width` columns; a blank line
    between the top-level blocks. No line is wider than `width` (a long default is cut with ...)."""
    import textwrap

    lines = [
        "== Config keys (key=default with these overrides, type, help) ==",
        "Override any of them (key=value); `disttrain config` prints the resolved config",
    ]
    block = None
    for key, tp, default, text in key_rows(cfg):
        if key.split(".", 1)[0] != block:
            block = key.split(".", 1)[0]
            lines.append("")
        head = f"{key}  ({tp})" if tp == "group" else f"{key}={default}  ({tp})"
        if len(head) > width:
            room = width - len(f"{key}=...  ({tp})")
            head = f"{key}={default[: max(room, 0)]}...  ({tp})" if room > 8 else head[: width - 3] + "..."
        lines.append(head)
        lines += textwrap.wrap(
            text, width, initial_indent=INDENT, subsequent_indent=INDENT, break_on_hyphens=False
        )
    return "\n".join(lines) + "\n"
