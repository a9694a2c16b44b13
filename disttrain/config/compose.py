"""Compose the Hydra config in the parent, once, with the same search path `@hydra.main` uses.

This module must not import torch: `disttrain config` and `disttrain --help` stay fast.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from disttrain.config.errors import ConfigError, translate
from disttrain.config.launch_checks import elastic_nodes
from disttrain.config.schema import register

CONFIG_NAME = "config"


def config_dir() -> Path:
    """The built-in config folder: $DISTTRAIN_CONFIG_DIR, else `configs/` beside the package."""
    env = os.environ.get("DISTTRAIN_CONFIG_DIR")
    if env:
        return Path(env).resolve()
    here = Path(__file__).resolve().parent.parent
    for candidate in (here.parent / "configs", here / "configs"):
        if (candidate / f"{CONFIG_NAME}.yaml").is_file():
            return candidate
    raise FileNotFoundError(f"disttrain's configs/ folder was not found next to {here}")


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
    """Compose `config_name` with `overrides`; raise ConfigError for every mistake of the user's."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register()
    extra = _search_path_override(user_config_dir)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3", job_name="disttrain"):
            cfg = hydra_compose(config_name, overrides=overrides + extra, return_hydra_config=with_hydra)
    except ConfigError:
        raise
    except Exception as exc:
        err = translate(exc, overrides)
        if err is None:
            raise
        raise err from None
    finally:
        GlobalHydra.instance().clear()
    return cfg


def resolve(cfg: DictConfig, overrides: list[str] | None = None) -> dict[str, Any]:
    """Resolve every interpolation now (once, in the parent) and return plain containers."""
    try:
        cfg = cfg.copy()
        if "hydra" in cfg:
            with _open(cfg):
                del cfg["hydra"]
        container = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except Exception as exc:
        err = translate(exc, overrides or [])
        if err is None:
            raise
        raise err from None
    assert isinstance(container, dict)
    elastic_nodes(container)  # type: ignore[arg-type]
    return container  # type: ignore[return-value]


def _open(cfg: DictConfig) -> Any:
    from omegaconf import open_dict

    return open_dict(cfg)


def expand_sweep(overrides: list[str]) -> list[list[str]]:
    """The override lists `-m` would run, one per job, as Hydra's basic sweeper splits them."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ChoiceSweep, RangeSweep

    parser = OverridesParser.create()
    parsed = parser.parse_overrides(overrides)
    plugin_syntax = any(
        o.is_sweep_override() and not isinstance(o.value(), ChoiceSweep | RangeSweep) for o in parsed
    )
    if plugin_syntax or any(o.key_or_group == "hydra/sweeper" for o in parsed):
        # A sweeper plugin (hydra/sweeper=optuna, interval(...)) chooses the values: the base job is
        # checked here, every job as the plugin launches it.
        return [
            [
                str(o.input_line)
                for o in parsed
                if not o.is_sweep_override() or o.key_or_group.startswith("hydra")
            ]
        ]
    batches = BasicSweeper.split_arguments(parsed, None)
    return [list(job) for batch in batches for job in batch]
