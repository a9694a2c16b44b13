"""Every use of Hydra's private names (Hydra 1.3), each with the reason no public API does the job.

The rest of disttrain uses `hydra.compose`, `hydra.main`, `hydra.utils`, the override parser and
`omegaconf` as documented. A Hydra upgrade that moves one of these breaks here, and only here.
"""

from __future__ import annotations

from typing import Any

# Hydra's default sweeper and launcher, by the `_target_` a composed config names them with: `-m`
# with exactly these runs in disttrain's own loop (commands/train.py `_basic_sweep`); any other
# sweeper or launcher (a plugin) runs under `@hydra.main`.
BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
BASIC_LAUNCHER = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"


def args_parser() -> Any:
    """Hydra's own parser of its command line (-m, --cfg, --config-dir, -sc, --help, overrides).

    Hydra has no public parser of its command line; `hydra.main` parses sys.argv itself and shows
    the task only the composed config. disttrain must read the same flags and overrides first, to
    check every job before Hydra creates a run dir; a copy of the parser would drift from the
    installed Hydra's flags."""
    from hydra._internal.utils import get_args_parser

    return get_args_parser()


def split_sweep(parsed: list[Any]) -> list[list[list[str]]]:
    """The basic sweeper's batches of jobs for overrides already parsed (`OverridesParser`).

    No public API expands a sweep, and the jobs must be the very strings the sweeper hands each job
    (`hc.overrides.task`: a job's checked config is found by them); a copy of its rules (key order,
    last value wins) could drift."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    batches: list[list[list[str]]] = BasicSweeper.split_arguments(parsed, None)
    return batches


def complete(config_loader: Any, line: str) -> list[str]:
    """Hydra's completions of an override `line` (without the program and subcommand).

    `DefaultCompletionPlugin._query(config_name, line)` is the one method that completes a line
    without reading the shell's COMP_LINE variables and printing; Hydra 1.3 has no public
    completion call."""
    from hydra.plugins.completion_plugin import DefaultCompletionPlugin

    found: list[str] = DefaultCompletionPlugin(config_loader)._query("config", line)
    return found
