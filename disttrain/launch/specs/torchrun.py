"""torchrun (the default launcher): its config and spec. A rank torchrun started (here or by a
Kubeflow runtime, TorchX dist.ddp, SkyPilot) carries TORCHELASTIC_RUN_ID."""

from __future__ import annotations

from dataclasses import dataclass

from disttrain.config.schema import LauncherConfig
from disttrain.launch.specs import LAUNCHERS, Environ, LauncherSpec


@dataclass
class TorchrunLauncherConfig(LauncherConfig):
    name: str = "torchrun"


def detect(environ: Environ) -> bool:
    return "TORCHELASTIC_RUN_ID" in environ


SPEC = LAUNCHERS.register(
    LauncherSpec(
        "torchrun",
        TorchrunLauncherConfig,
        "disttrain.launch.torchrun:TorchrunLauncher",
        "torchrun (the default): torch's elastic agent starts each node's ranks",
        detect=detect,
    )
)
