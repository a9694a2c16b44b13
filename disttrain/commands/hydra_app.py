"""Where disttrain relies on Hydra beyond its public API: each use behind one function, with the
reason no public API does the job (Hydra 1.3). Everything else uses `hydra.compose`,
`hydra.main`, `hydra.utils` and `omegaconf` as documented.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


def parse_args(argv: list[str]) -> Any:
    """`argv` parsed exactly as `@hydra.main` will parse it (-m, --cfg, --config-dir, -sc, --help,
    the overrides).

    Private: Hydra has no public parser of its own command line; `hydra.main` parses sys.argv
    itself and shows the task only the composed config. disttrain must read the same flags and
    overrides first, to check every job before Hydra creates a run dir; a copy of the parser would
    drift from the installed Hydra's flags.
    """
    from hydra._internal.utils import get_args_parser

    return get_args_parser().parse_args(argv)


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
