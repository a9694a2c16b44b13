"""spawn (torch.multiprocessing on one node): its config and spec. It makes no environment of its
own to detect: its ranks run inside the parent's."""

from __future__ import annotations

from dataclasses import dataclass

from disttrain.config.schema import LauncherConfig
from disttrain.launch.specs import LAUNCHERS, LauncherSpec


@dataclass
class SpawnLauncherConfig(LauncherConfig):
    name: str = "spawn"


SPEC = LAUNCHERS.register(
    LauncherSpec(
        "spawn",
        SpawnLauncherConfig,
        "disttrain.launch.spawn:SpawnLauncher",
        "spawn: torch.multiprocessing on one node",
    )
)
