"""Every use of Hydra's private names and process-wide state (Hydra 1.3), each with the reason no
public API does the job.

The rest of disttrain uses `hydra.compose`, `hydra.main`, `hydra.utils`, the override parser and
`omegaconf` as documented, and writes none of Hydra's singletons (`GlobalHydra`, `HydraConfig`).
A Hydra upgrade that moves one of these breaks here, and only here.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def args_parser() -> Any:
    """Hydra's own parser of its command line (-m, --cfg, --config-dir, -sc, --help, overrides).

    Hydra has no public parser of its command line; `hydra.main` parses sys.argv itself and shows
    the task only the composed config. disttrain must read the same flags and overrides first, to
    check every job before Hydra creates a run dir; a copy of the parser would drift from the
    installed Hydra's flags."""
    from hydra._internal.utils import get_args_parser

    return get_args_parser()


@contextmanager
def global_hydra_cleared() -> Iterator[None]:
    """Hydra's process-wide `GlobalHydra` cleared before and after: the public compose API
    (`initialize_config_dir`) refuses to start while it holds another initialisation (that of the
    `@hydra.main` around a plugin's job), and leaves its own behind on an error."""
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    try:
        yield
    finally:
        GlobalHydra.instance().clear()


def complete(config_dir: str, line: str) -> list[str]:
    """Hydra's completions of an override `line` (without the program and subcommand).

    `DefaultCompletionPlugin._query(config_name, line)` is the one method that completes a line
    without reading the shell's COMP_LINE variables and printing; Hydra 1.3 has no public
    completion call. Its config loader is `GlobalHydra`'s, set up by the public compose API."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.plugins.completion_plugin import DefaultCompletionPlugin

    with global_hydra_cleared(), initialize_config_dir(config_dir=config_dir, version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()
        found: list[str] = DefaultCompletionPlugin(loader)._query("config", line)
    return found
