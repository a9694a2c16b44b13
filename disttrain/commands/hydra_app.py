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
