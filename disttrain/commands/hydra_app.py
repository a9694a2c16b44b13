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


def hide_schemas_in_help() -> None:
    """`--help` lists each group's options; the `base_*` schemas the YAML options extend (Hydra's
    extend-a-schema pattern) are not choices, so they are left out of that list.

    Private: the option lists come from `Hydra.format_config_groups`, which `--help` calls
    directly; `hydra.help.template` can only place its text (`$APP_CONFIG_GROUPS`), not filter it,
    and there is no public listing of a group's options to write the list ourselves. So that
    method is wrapped (once, idempotent) to drop `base_*` entries.
    """
    from hydra._internal.hydra import Hydra

    original = Hydra.format_config_groups
    if getattr(original, "_disttrain", False):
        return

    def format_config_groups(self: Hydra, predicate: Callable[[str], bool], compact: bool = True) -> str:
        lines = []
        for line in original(self, predicate, compact).splitlines():
            head, sep, items = line.partition(": ")
            if sep and compact:
                line = head + sep + ", ".join(o for o in items.split(", ") if not o.startswith("base_"))
            if not line.strip().startswith("base_"):
                lines.append(line)
        return "".join(f"{line}\n" for line in lines)

    format_config_groups._disttrain = True  # type: ignore[attr-defined]
    Hydra.format_config_groups = format_config_groups  # type: ignore[method-assign]
