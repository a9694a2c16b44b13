"""The launcher registry: one torch-free spec per launcher, iterated by the schema, the checks and
`launch`. A new launcher is one module (a `Launcher` subclass), one `register_launcher(spec)` and one
YAML under `configs/launcher/` (or a `--config-dir`) whose defaults name `base_<name>`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from disttrain.config import schema

if TYPE_CHECKING:
    from disttrain.launch.base import Launcher


@dataclass(frozen=True)
class LauncherSpec:
    """What config and checks know of a launcher without importing it."""

    name: str  # `launcher.name`, and the schema's ConfigStore name `launcher/base_<name>`
    config: type[schema.LauncherConfig]  # its typed config: the only home of its defaults
    target: str  # "module:Class" of its `Launcher`, imported only when it is checked or runs
    help: str  # one line for `launcher.name`'s allowed values

    def load(self) -> Launcher:
        module, _, cls = self.target.partition(":")
        launcher: Launcher = getattr(importlib.import_module(module), cls)()
        return launcher


_SPECS: dict[str, LauncherSpec] = {}


def register_launcher(spec: LauncherSpec) -> None:
    """Add (or replace) a launcher; the next compose stores its schema as `launcher/base_<name>`."""
    _SPECS[spec.name] = spec


def launcher_specs() -> tuple[LauncherSpec, ...]:
    return tuple(_SPECS.values())


def launcher_names() -> tuple[str, ...]:
    return tuple(_SPECS)


def launcher_spec(cfg: dict[str, Any]) -> LauncherSpec:
    """The spec of `cfg`'s launcher (`launcher.name` is checked against the registry first)."""
    return _SPECS[cfg["launcher"]["name"]]


def launcher_for(cfg: dict[str, Any]) -> Launcher:
    return launcher_spec(cfg).load()


def launcher_config(cfg: dict[str, Any]) -> Any:
    """`cfg["launcher"]` as its launcher's typed config (defaults filled, types checked)."""
    from disttrain.config.typed import typed

    return typed(launcher_spec(cfg).config, cfg["launcher"])


for _spec in (
    LauncherSpec(
        "torchrun",
        schema.TorchrunLauncherConfig,
        "disttrain.launch.torchrun:TorchrunLauncher",
        "torchrun (the default): torch's elastic agent starts each node's ranks",
    ),
    LauncherSpec(
        "spawn",
        schema.SpawnLauncherConfig,
        "disttrain.launch.spawn:SpawnLauncher",
        "spawn: torch.multiprocessing on one node",
    ),
    LauncherSpec(
        "slurm",
        schema.SlurmLauncherConfig,
        "disttrain.launch.slurm:SlurmLauncher",
        "slurm: submits an sbatch job",
    ),
    LauncherSpec(
        "k8s",
        schema.K8sLauncherConfig,
        "disttrain.launch.k8s:K8sLauncher",
        "k8s: applies a Kubeflow TrainJob",
    ),
):
    register_launcher(_spec)
