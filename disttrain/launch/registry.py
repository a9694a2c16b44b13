"""The launcher of a resolved config, through the registry (`disttrain.launch.specs.LAUNCHERS`):
`launch`, the checks and the commands ask here, and nothing else compares launcher names.
A new launcher is one module (a `Launcher` subclass, its config and its spec, registered in the
`disttrain.launchers` entry-point group) and one YAML under `launcher/` whose defaults name
`base_<name>`: see `disttrain.launch.specs`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from disttrain.launch.specs import LAUNCHERS, LauncherSpec

if TYPE_CHECKING:
    from disttrain.config.run import Run
    from disttrain.launch.base import Launcher

__all__ = [
    "LAUNCHERS",
    "LauncherSpec",
    "launcher_for",
    "launcher_names",
    "launcher_spec",
    "launcher_specs",
    "register_launcher",
]

register_launcher = LAUNCHERS.register


def launcher_specs() -> tuple[LauncherSpec, ...]:
    return tuple(LAUNCHERS.all())


def launcher_names() -> tuple[str, ...]:
    return tuple(LAUNCHERS.names())


def launcher_spec(run: Run) -> LauncherSpec:
    """The spec of `run`'s launcher (an unknown `launcher.name`: the ConfigError listing the known)."""
    return LAUNCHERS.get(run.launcher.name)


def launcher_for(run: Run) -> Launcher:
    return launcher_spec(run).load()
