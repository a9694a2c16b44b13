"""Compose the Hydra config in the parent, once, with the same search path `@hydra.main` uses.

This module must not import torch: `disttrain config` and `disttrain --help` stay fast. Nor, at
import time, OmegaConf or the schemas: every rank imports this package (for ConfigError) and
never composes.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from disttrain.config.errors import ConfigError, _fields, translate, translated, unknown_key_hint
from disttrain.config.gpus import resolve_nproc

if TYPE_CHECKING:
    from omegaconf import DictConfig

CONFIG_NAME = "config"


def elastic_nodes(cfg: dict[str, Any]) -> None:
    """`nodes=MIN:MAX` (torchrun's --nnodes syntax) becomes nodes=MAX, launcher.min_nodes=MIN.

    Every later step (checks, launch, the frozen config and its hash) then sees one spelling.
    """
    value = cfg.get("nodes")
    if isinstance(value, int) and not isinstance(value, bool):
        return
    match = None if isinstance(value, bool) else re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", str(value))
    low, high = (int(match[1]), int(match[2] or match[1])) if match else (0, 0)
    if not match or not 1 <= low <= high:
        raise ConfigError(
            "nodes",
            value,
            "an integer >= 1, or MIN:MAX with 1 <= MIN <= MAX (elastic membership)",
            "nodes=2 needs both nodes; nodes=1:2 starts with whichever of 2 nodes arrive (at least 1).",
        )
    given = cfg["launcher"]["min_nodes"]
    if match[2] is not None and given not in (0, low):
        raise ConfigError(
            "launcher.min_nodes",
            given,
            f"0 or {low} (nodes={value} already sets the minimum)",
            "write the range once: nodes=MIN:MAX, or nodes=MAX launcher.min_nodes=MIN.",
        )
    cfg["nodes"] = high
    if match[2] is not None:
        cfg.setdefault("launcher", {})["min_nodes"] = low


def config_dir() -> Path:
    """The built-in config folder: $DISTTRAIN_CONFIG_DIR, else `disttrain/configs`, else `configs/`.

    `disttrain/configs` is an installed wheel's (setup.py maps the top-level `configs/` there, so a
    wheel installed anywhere has its configs); the checkout's top-level `configs/` serves a source
    tree on PYTHONPATH and an editable install. `--config-dir` and experiment files are added on
    top of this search path.
    """
    env = os.environ.get("DISTTRAIN_CONFIG_DIR")
    if env:
        return Path(env).resolve()
    import disttrain

    return _builtin_config_dir(Path(disttrain.__file__).parent)


def _builtin_config_dir(package: Path) -> Path:
    """`package`/configs (the wheel's layout), else `package`/../configs (the checkout's)."""
    candidates = (package / "configs", package.parent / "configs")
    for folder in candidates:
        if (folder / f"{CONFIG_NAME}.yaml").is_file():
            return folder
    raise FileNotFoundError(
        f"disttrain's configs are missing: no {CONFIG_NAME}.yaml in {' or '.join(map(str, candidates))}: "
        "reinstall disttrain, or point DISTTRAIN_CONFIG_DIR at a folder holding config.yaml and its groups"
    )


def _search_path_override(user_dir: str | None) -> list[str]:
    if user_dir is None:
        return []
    path = Path(user_dir).resolve()
    if not path.is_dir():
        raise ConfigError(
            "--config-dir",
            user_dir,
            "an existing folder",
            "create it, or check the path (relative to the cwd).",
        )
    return [f"hydra.searchpath=[file://{path}]"]


def compose(
    overrides: list[str],
    user_config_dir: str | None = None,
    config_name: str = CONFIG_NAME,
    with_hydra: bool = False,
) -> DictConfig:
    """Compose `config_name` with `overrides`; raise ConfigError for every mistake of the user's.

    The `_target_` nodes are then settled (config/clean.py): a swapped `_target_` starts clean.
    """
    from disttrain.config.clean import settle
    from disttrain.config.extras import check_options

    check_options(overrides)  # hydra/sweeper=optuna without the extra: the install command
    cfg = _compose(overrides, user_config_dir, config_name, with_hydra)
    with translated(overrides):
        settle(cfg, overrides, lambda ovs: _compose(ovs, user_config_dir, config_name, False))
    return cfg


def _compose(
    overrides: list[str], user_config_dir: str | None, config_name: str, with_hydra: bool
) -> DictConfig:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from disttrain.config.hydra_private import global_hydra_cleared
    from disttrain.config.schema import register
    from disttrain.timing import mark

    mark("compose_start")
    register()
    extra = _search_path_override(user_config_dir)
    primary = config_dir()
    if user_config_dir and (Path(user_config_dir) / f"{config_name}.yaml").is_file():
        # As @hydra.main's --config-dir: the primary config may live there (a k8s pod's frozen.yaml).
        primary, extra = Path(user_config_dir).resolve(), [f"hydra.searchpath=[file://{primary}]"]
    with (
        global_hydra_cleared(),
        translated(overrides),
        initialize_config_dir(config_dir=str(primary), version_base="1.3", job_name="disttrain"),
    ):
        cfg = hydra_compose(config_name, overrides=overrides + extra, return_hydra_config=with_hydra)
    _check_adds(cfg, overrides, user_config_dir)
    mark("compose_end")
    return cfg


def _check_adds(cfg: DictConfig, overrides: list[str], user_config_dir: str | None) -> None:
    """Hydra accepts `+trainer.max_step=10` into a typed block, where nothing reads it."""
    adds = [o for o in overrides if o.startswith("+") and not o.startswith("++") and "=" in o]
    folders = [config_dir()] + ([Path(user_config_dir)] if user_config_dir else [])
    for override in adds:
        key, _, value = override[1:].partition("=")
        if key.startswith("hydra.") or any((d / key.split("@")[0]).is_dir() for d in folders):
            continue  # a config group (+experiment=x), or Hydra's own settings
        error = typed_add_error(cfg, key, value)
        if error is not None:
            raise error


def typed_add_error(cfg: Any, key: str, value: Any) -> ConfigError | None:
    """`+key=value` into a typed block (trainer, launcher, checkpoint, ...) adds a key nothing reads:
    an error naming the closest key. Under a `_target_` node (model, optim, data sets) or an
    untyped one, adding a key is how the user's class gets its argument: None."""
    from omegaconf import OmegaConf

    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(cfg, parent, default=None) if parent else cfg
    while node is None and parent:  # +a.b.c where a.b is new: judge by the nearest existing ancestor
        parent, _, leaf = parent.rpartition(".")
        node = OmegaConf.select(cfg, parent, default=None) if parent else cfg
    object_type = OmegaConf.get_type(node) if OmegaConf.is_dict(node) else None
    if not dataclasses.is_dataclass(object_type) or "_target_" in node:
        return None
    allowed = [k for k in _fields(object_type) if k != leaf]
    if leaf in _fields(object_type):
        return ConfigError(
            f"+{key}", value, f"{key}=VALUE (the key exists)", f"drop the +: write {key}={value}."
        )
    return ConfigError(
        key,
        value,
        f"the keys of {parent or 'the top level'}: {', '.join(allowed)}",
        unknown_key_hint(key, allowed, False),
    )


def resolve(cfg: DictConfig, overrides: list[str] | None = None) -> dict[str, Any]:
    """Resolve every interpolation now (once, in the parent) and return plain containers."""
    from omegaconf import OmegaConf

    try:
        cfg = cfg.copy()
        if "hydra" in cfg:
            with _open(cfg):
                del cfg["hydra"]
        _check_missing(cfg)
        _check_sizes_read(cfg)
        # closed choices (config.common.Choice) as their plain strings: config.yaml is plain YAML
        container = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True, enum_to_str=True)
    except Exception as exc:
        err = translate(exc, overrides or [])
        if err is None:
            raise
        raise err from None
    assert isinstance(container, dict)
    elastic_nodes(container)  # type: ignore[arg-type]
    resolve_nproc(container)  # type: ignore[arg-type]  # auto -> a number, before anything reads it
    absolute_paths(container)  # type: ignore[arg-type]
    return container  # type: ignore[return-value]


def absolute_paths(cfg: dict[str, Any]) -> None:
    """Relative file paths made absolute against this command's working directory, so config.yaml
    freezes where they pointed when the run was made: a resume, export or eval from another folder
    reads the same checkpoints and data (review 2026-11-28-reliability D4). `checkpoint.dir` always
    (it is created); `init.path` and the data nodes' `path`, `val_path`, `*_path` keys (at any
    depth: data.train, a mixture's sources) only where something exists there, since a data path
    may be a Hugging Face Hub name (`data.path=imdb`); a token glob where it matches; `data.tokenizer`
    where it exists and `data.cache_dir` always. Not for a
    launcher whose nodes have their own file system (`own_files`: a Kubernetes pod's image)."""
    import glob

    from disttrain.launch.specs import LAUNCHERS

    name = cfg.get("launcher", {}).get("name") if isinstance(cfg.get("launcher"), dict) else None
    if name in LAUNCHERS.names() and LAUNCHERS.get(name).own_files:
        return

    def absolute(value: Any, must_exist: bool) -> Any:
        if not isinstance(value, str) or not value or os.path.isabs(value) or value.startswith("~"):
            return value
        if "://" in value:  # s3://, gs://: a location in an object store, never under the cwd
            return value
        if must_exist and not (os.path.lexists(value) or (glob.has_magic(value) and glob.glob(value))):
            return value
        return os.path.join(os.getcwd(), value)

    def data_paths(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("path", "val_path", "tokenizer") or (
                    isinstance(key, str) and key.endswith("_path")
                ):
                    node[key] = absolute(value, must_exist=True)
                elif key == "cache_dir":  # data.cache_dir (data.tokenizer's cache): created when missing
                    node[key] = absolute(value, must_exist=False)
                else:
                    data_paths(value)
        elif isinstance(node, list):
            for value in node:
                data_paths(value)

    for block, key, must_exist in (("checkpoint", "dir", False), ("init", "path", True)):
        if isinstance(cfg.get(block), dict) and key in cfg[block]:
            cfg[block][key] = absolute(cfg[block][key], must_exist)
    data_paths(cfg.get("data"))


def _check_missing(cfg: DictConfig) -> None:
    """Every `???` at once, the file path first: resolving stops at the first interpolation that
    reaches one (data=files without a path named model.in_features, which reads data.num_features)."""
    missing = sorted(_missing_keys(cfg, ""), key=lambda k: (not k.endswith("path"), k))
    if missing:
        also = f" (also without a value: {', '.join(missing[1:])})" if missing[1:] else ""
        raise ConfigError(
            missing[0], "???", "a value (this key has no default)", f"set it: {missing[0]}=VALUE{also}."
        )


def _check_sizes_read(cfg: DictConfig) -> None:
    """data.num_features and data.num_classes may be null (data=hf: a model that knows its own
    sizes, task=model_loss); one that another key reads (model=gpt's vocab_size) must be set."""
    from omegaconf import OmegaConf

    for key in ("num_features", "num_classes"):
        name = f"data.{key}"
        if "data" not in cfg or key not in cfg.data or OmegaConf.select(cfg, name) is not None:
            continue
        reader = next(
            (
                path
                for path, text in _interpolations(cfg, "")
                if name in text and not path.startswith("data.")
            ),
            None,
        )
        if reader is not None:
            what = (
                "the sequence length (data=hf: data.block_size sets it)"
                if key == "num_features"
                else "the vocabulary size"
            )
            raise ConfigError(
                name,
                None,
                f"a number: {reader} reads it",
                f"set {name}=N, {what}, or use a model that knows its own.",
            )


def _interpolations(node: Any, prefix: str) -> list[tuple[str, str]]:
    """(dotted key, text) of every interpolation under `node`, unresolved."""
    from omegaconf import OmegaConf

    found: list[tuple[str, str]] = []
    names = list(node.keys()) if OmegaConf.is_dict(node) else range(len(node))
    for key in names:
        child: Any = node._get_node(key)
        path = f"{prefix}{key}"
        if OmegaConf.is_dict(child) or OmegaConf.is_list(child):
            found += _interpolations(child, f"{path}.")
        elif child is not None and child._is_interpolation():
            found.append((path, str(child._value())))
    return found


def _missing_keys(node: Any, prefix: str) -> list[str]:
    """Dotted keys holding a literal `???` (OmegaConf.missing_keys resolves interpolations and so
    fails on the first one that reaches a missing value)."""
    from omegaconf import OmegaConf

    keys: list[str] = []
    names = list(node.keys()) if OmegaConf.is_dict(node) else range(len(node))
    for key in names:
        child: Any = node._get_node(key)
        path = f"{prefix}{key}"
        if OmegaConf.is_dict(child) or OmegaConf.is_list(child):
            keys += _missing_keys(child, f"{path}.")
        elif child is not None and child._is_missing() and not child._is_interpolation():
            keys.append(path)
    return keys


def _open(cfg: DictConfig) -> Any:
    from omegaconf import open_dict

    return open_dict(cfg)


def expand_sweep(overrides: list[str]) -> list[list[str]]:
    """The override lists `-m` would run, one per job, as Hydra's basic sweeper splits them: every
    choice or range of values as `key=value`, one value per key (a later override of a key replaces
    an earlier one, keeping its place), the jobs as their product in that order."""
    import itertools

    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    if _chosen_by_plugin(parsed):
        # A sweeper plugin (hydra/sweeper=optuna, interval(...)) chooses the values: the base job is
        # checked here, every job as the plugin launches it.
        return [
            [
                str(o.input_line)
                for o in parsed
                if not o.is_sweep_override() or o.key_or_group.startswith("hydra")
            ]
        ]
    values: dict[str, list[str]] = {}
    for o in parsed:
        key = o.get_key_element()
        one = [o.get_value_element_as_str()] if not o.is_sweep_override() else o.sweep_string_iterator()
        values[key] = [f"{key}={value}" for value in one]
    return [list(job) for job in itertools.product(*values.values())]


def plugin_sweep(overrides: list[str]) -> bool:
    """Whether a sweeper plugin chooses the jobs: `hydra/sweeper=...` is set, or a sweep uses syntax
    only a plugin expands (Optuna's `interval(...)`; `glob(...)`, which Hydra expands against the
    config groups as it launches); Hydra's basic sweeper takes choices (`a,b`) and ranges here."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return _chosen_by_plugin(OverridesParser.create().parse_overrides(overrides))


def _chosen_by_plugin(parsed: list[Any]) -> bool:
    """`plugin_sweep` of overrides already parsed."""
    from hydra.core.override_parser.types import ChoiceSweep, RangeSweep

    return any(o.key_or_group == "hydra/sweeper" for o in parsed) or any(
        o.is_sweep_override() and not isinstance(o.value(), ChoiceSweep | RangeSweep) for o in parsed
    )
