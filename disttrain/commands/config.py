"""`disttrain config [key=value ...]`: the resolved config after `train`'s composition and checks;
and the helpers `train` shares with it (compose + check, every key's help)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from disttrain.commands.hydra_app import parse_args

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from disttrain.config.run import Run


def compose_checked(overrides: list[str], args: Any, runtime: bool) -> tuple[Run, DictConfig]:
    """Compose with `train`'s flags (--config-dir/--config-name), resolve, build the Run and run
    the static checks (and the runtime ones: the machine, a dry build); ConfigError on any mistake.
    The checked run and the composition it came from, with Hydra's node (`train` takes the run dir
    from it)."""
    from disttrain.config import compose, resolve
    from disttrain.config.run import Run
    from disttrain.preflight.checks import check_runtime, check_static
    from disttrain.timing import mark

    full = compose(overrides, args.config_dir, args.config_name or "config", with_hydra=True)
    run = Run.of(resolve(full, overrides))
    check_static(run)
    mark("static_checks")
    if runtime:
        from disttrain.launch import prestart

        prestart(run)  # e.g. the ranks' fork server imports torch while the checks below run
        check_runtime(run)
        mark("runtime_checks")
    return run, full


def key_help(args: Any, footer: str = "") -> int:
    """Each key's type, default (given the overrides' group choices) and the schema's help text."""
    from disttrain.config import compose
    from disttrain.config.keyhelp import format_keys

    sys.stdout.write(format_keys(compose(args.overrides, args.config_dir, args.config_name or "config")))
    sys.stdout.write(footer)
    return 0


def cmd_config(rest: list[str]) -> int:
    """Print the resolved config (the same composition and static checks as `train`)."""
    import yaml

    args = parse_args(rest)
    if args.help:
        sys.stdout.write("usage: disttrain config [--config-dir DIR] [key=value ...]\n\n")
        return key_help(args)
    run, _ = compose_checked(args.overrides, args, runtime=False)
    sys.stdout.write(yaml.safe_dump(run.to_dict(), sort_keys=False))
    return 0
