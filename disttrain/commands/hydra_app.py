"""The commands' ways into Hydra: its command-line parser and `@hydra.main` with a given argv, and
the `--help` groups resolver. Hydra's private names live in config/hydra_private.py only.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


def parse_args(argv: list[str]) -> Any:
    """`argv` parsed exactly as `@hydra.main` will parse it (-m, --cfg, --config-dir, -sc, --help,
    the overrides), by Hydra's own parser (private: config/hydra_private.py)."""
    from disttrain.config.hydra_private import args_parser

    return args_parser().parse_args(argv)


def run_main(task: Callable[[Any], Any], config_path: str, config_name: str, argv: list[str]) -> None:
    """Run `task` under `@hydra.main` with `argv` as its command line (no `train` subcommand).

    Public API, process-global: the function `hydra.main` returns takes no arguments and reads
    sys.argv (Hydra 1.3 has no argv parameter; `_run_hydra(args=...)` is private). So sys.argv is
    set for the call and restored afterwards, here only.
    """
    import hydra

    saved = sys.argv
    sys.argv = [saved[0], *argv]
    try:
        hydra.main(config_path=config_path, config_name=config_name, version_base="1.3")(task)()
    finally:
        sys.argv = saved


GROUPS_RESOLVER = "disttrain_groups"


def register_help_resolver() -> None:
    """`${disttrain_groups:}`, used by the `hydra.help.template` of disttrain's config.yaml: each
    app config group with its options, as Hydra's `$APP_CONFIG_GROUPS` lists them, but without the
    `base_*` schemas the YAML options extend (Hydra's extend-a-schema pattern; they are no choices).

    Public API only: a help template (Hydra's documented way to customise `--help`), an OmegaConf
    resolver, and the `ConfigLoader` interface Hydra hands its plugins (`GlobalHydra`).
    """
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver(GROUPS_RESOLVER):
        OmegaConf.register_new_resolver(GROUPS_RESOLVER, app_config_groups)


def app_config_groups() -> str:
    """ "group: option, option" lines for every non-hydra group of the running Hydra app."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.object_type import ObjectType

    loader = GlobalHydra.instance().config_loader()

    def groups(parent: str) -> list[str]:
        found = []
        for name in loader.list_groups(parent):
            group = f"{parent}/{name}" if parent else name
            if loader.get_group_options(group, ObjectType.CONFIG):
                found.append(group)
            if loader.get_group_options(group, ObjectType.GROUP):
                found += groups(group)
        return found

    lines = []
    for group in sorted(g for g in groups("") if g != "hydra" and not g.startswith("hydra/")):
        options = sorted(o for o in loader.get_group_options(group) if not o.startswith("base_"))
        lines.append(f"{group}: {', '.join(options)}\n")
    return "".join(lines)
