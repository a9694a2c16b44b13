"""Optimizer (a `_partial_` Hydra target) and the learning-rate schedule."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from disttrain.config.instantiate import build

log = logging.getLogger("disttrain")


def effective_lr(optim_cfg: dict[str, Any], world_size: int) -> float:
    """The linear scaling rule (Goyal et al. 2017) when `optim.scale_lr=linear`."""
    lr = float(optim_cfg["lr"])
    return lr * world_size if optim_cfg.get("scale_lr", "none") == "linear" else lr


def build_optimizer(
    optim_cfg: dict[str, Any], params: Iterable[torch.nn.Parameter], world_size: int
) -> torch.optim.Optimizer:
    spec = {k: v for k, v in optim_cfg.items() if k != "scale_lr"}
    spec["lr"] = effective_lr(optim_cfg, world_size)
    if spec["lr"] != optim_cfg["lr"]:
        log.info(
            "optim.scale_lr=linear: lr %.3g x world size %d = %.3g", optim_cfg["lr"], world_size, spec["lr"]
        )
    factory = build(spec, "optim")
    optimizer: torch.optim.Optimizer = factory(params)
    return optimizer


def lr_lambda(sched_cfg: dict[str, Any], total_steps: int) -> Any:
    """Multiplier of the base lr at optimizer step `s`: linear warm-up, then constant or cosine."""
    warmup = int(sched_cfg.get("warmup_steps", 0))
    name = sched_cfg["name"]
    floor = float(sched_cfg.get("min_lr_ratio", 0.0))

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if name == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def build_scheduler(
    sched_cfg: dict[str, Any], optimizer: torch.optim.Optimizer, total_steps: int
) -> LambdaLR:
    return LambdaLR(optimizer, lr_lambda(sched_cfg, total_steps))
