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
    """The built-in config folder: $DISTTRAIN_CONFIG_DIR, else the package's own `disttrain/configs`.

    Found with importlib.resources, so a wheel installed anywhere (not only an editable checkout)
    has its configs; `--config-dir` and experiment files are added on top of this search path.
    """
    env = os.environ.get("DISTTRAIN_CONFIG_DIR")
    if env:
        return Path(env).resolve()
    from importlib.resources import files

    shipped = Path(str(files("disttrain") / "configs"))
    if not (shipped / f"{CONFIG_NAME}.yaml").is_file():
        raise FileNotFoundError(
            f"disttrain's configs are missing from the installed package ({shipped}): reinstall disttrain, "
            "or point DISTTRAIN_CONFIG_DIR at a folder holding config.yaml and its groups"
        )
    return shipped


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

    parser = OverridesParser.create()
    parsed = parser.parse_overrides(overrides)
    batches = BasicSweeper.split_arguments(parsed, None)
    return [list(job) for batch in batches for job in batch]
