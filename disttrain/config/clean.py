"""`_target_` nodes after composition: a swapped `_target_` starts from a clean node.

The plug-in nodes (model, optim, sched, task, data.train, data.val) are open in the schema, so a user may
write keys the built-in option lacks, on the command line (`model.hidden_size=128`, no `+`) or in a
YAML (`model: {_target_: mylab.Net, width: 96}`). After composition each node is settled:

- its `_target_` is the built-in option's: a key close to one of the option's own keys is a typo
  (ConfigError with a suggestion); other keys are checked against the target's signature when it
  is built (check_runtime, before launch).
- its `_target_` was swapped: the node is rebuilt from what the user wrote for it, nothing of the
  built-in option's keys (no leftover mlp `hidden`, `dropout`... that the new class would get or
  reject). What the user wrote is found by composing once more with that group left out of the
  defaults list (`~model`; `~data` for data.train/val): the command line, an experiment and the
  user's own config files still apply, the built-in option does not. optim and sched keep the keys
  disttrain itself reads (lr, weight_decay, scale_lr, param_groups; `_partial_`) from their schema.

The frozen config.yaml holds the settled nodes, so a resume or re-run builds the same objects.
This module must not import torch (`disttrain config` stays fast).
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from disttrain.config.errors import ConfigError

log = logging.getLogger("disttrain")

NODES = ("model", "optim", "sched", "task", "data.train", "data.val")
EXAMPLE = {
    "model": "mylab.nets.Net",
    "optim": "torch.optim.RMSprop",
    "sched": "torch.optim.lr_scheduler.StepLR",
    "task": "mylab.tasks.Weighted",
    "data.train": "mylab.data.make_train",
    "data.val": "mylab.data.make_val",
}


@dataclasses.dataclass(frozen=True)
class Builtin:
    """What the built-in option put at a node: its target (None: not a `_target_` node) and keys."""

    target: str | None
    keys: tuple[str, ...]


def builtin(cfg: DictConfig, key: str) -> Builtin | None:
    """The built-in option behind `key`, from the node's schema; None when the user's own node."""
    node = OmegaConf.select(cfg, key, throw_on_missing=False)
    if not isinstance(node, DictConfig):
        return None
    group, _, leaf = key.partition(".")
    if leaf:  # data.train / data.val: a field of the data option's schema
        schema = OmegaConf.get_type(cfg[group])
        if not dataclasses.is_dataclass(schema):
            return None
        field = {f.name: f for f in dataclasses.fields(schema)}.get(leaf)
        factory = getattr(field, "default_factory", dataclasses.MISSING)
        if factory is dataclasses.MISSING:
            return None
        default = factory()
        return Builtin(default.get("_target_"), tuple(default)) if isinstance(default, dict) else None
    schema = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(schema):
        return None
    fields = {f.name: f.default for f in dataclasses.fields(schema)}
    target = fields.get("_target_")
    return Builtin(target if isinstance(target, str) and target != "???" else None, tuple(fields))


def swapped(cfg: DictConfig, key: str) -> bool:
    """Does the node's `_target_` differ from the one its built-in option sets?"""
    info = builtin(cfg, key)
    if info is None:
        return False
    node = OmegaConf.select(cfg, key)
    if "_target_" not in node or OmegaConf.is_missing(node, "_target_"):
        return False
    return bool(node._get_node("_target_")._value() != info.target)


def settle(
    cfg: DictConfig, overrides: list[str], compose_without: Callable[[list[str]], DictConfig]
) -> list[str]:
    """Rebuild swapped nodes clean and check the others' keys; returns the swapped node keys."""
    keys = [k for k in NODES if swapped(cfg, k)]
    if keys:
        groups = sorted({k.partition(".")[0] for k in keys})
        written = compose_without(user_overrides(overrides, groups))
        for key in keys:
            _replace(cfg, key, clean_node(key, OmegaConf.select(written, key, throw_on_missing=False)))
            log.debug("%s: _target_ swapped; the node holds only what you wrote for it", key)
    for key in NODES:
        if key not in keys:
            check_builtin_keys(cfg, key)
    return keys


def user_overrides(overrides: list[str], groups: list[str]) -> list[str]:
    """`overrides` with `groups` left out of the defaults list; keys under them force-added (`++`)."""
    out = []
    for ov in overrides:
        body = ov.lstrip("~+")
        name = body.partition("=")[0].partition("@")[0]
        group = name.partition(".")[0]
        if group not in groups:
            out.append(ov)
        elif name != group and not ov.startswith("~"):
            out.append(f"++{body}")
    return out + [f"~{g}" for g in groups]


def clean_node(key: str, written: Any) -> Any:
    """The node a swapped `_target_` starts from: disttrain's own keys (optim, sched) + the user's."""
    from disttrain.config.schema import OptimConfig, TargetSchedConfig

    user = (
        OmegaConf.to_container(written, resolve=False, enum_to_str=True)
        if isinstance(written, DictConfig)
        else {}
    )
    base = {"optim": OptimConfig, "sched": TargetSchedConfig}.get(key)
    if base is None:
        return user
    node = OmegaConf.structured(base)
    OmegaConf.set_struct(node, False)
    return OmegaConf.merge(node, user)


def _replace(cfg: DictConfig, key: str, node: Any) -> None:
    parent_key, _, leaf = key.rpartition(".")
    parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
    with open_dict(parent):
        parent[leaf] = node


def check_builtin_keys(cfg: DictConfig, key: str) -> None:
    """A key of a built-in node that looks like a misspelt one of the option's own is a mistake.

    Other keys are left to the signature check when the target is built (they may be arguments the
    schema does not list, e.g. AdamW's amsgrad); a node without `_target_` (sched=cosine) has only
    its schema's keys.
    """
    info = builtin(cfg, key)
    if info is None:
        return
    node = OmegaConf.to_container(OmegaConf.select(cfg, key), resolve=False, enum_to_str=True)
    assert isinstance(node, dict)
    allowed = [k for k in info.keys if not k.startswith("_")]
    for raw, value in node.items():
        name = str(raw)
        if name in info.keys:
            continue
        close = difflib.get_close_matches(name, allowed, n=1)
        if info.target is None:
            raise ConfigError(
                f"{key}.{name}",
                value,
                f"the keys of {key}: {', '.join(allowed)}",
                (f"did you mean {key}.{close[0]}? " if close else "check the spelling. ")
                + f"Another class's arguments need its _target_ first, e.g. {key}._target_={EXAMPLE[key]}.",
            )
        if close:
            raise ConfigError(
                f"{key}.{name}",
                value,
                f"the keys of {key} ({info.target}): {', '.join(allowed)}",
                f"did you mean {key}.{close[0]}? Another class's arguments need its _target_ first: "
                f"{key}._target_={EXAMPLE[key]} {key}.{name}=VALUE.",
            )
