"""nn.DataParallel: one process drives every local GPU, splitting each batch across them.

The launcher starts a single process for it (config check: world size 1). Without CUDA GPUs
DataParallel simply calls the module on the CPU, which is said once, not silently.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from disttrain.strategies.base import Strategy

log = logging.getLogger("disttrain")


class DPStrategy(Strategy):
    def gpus_per_rank(self) -> int:
        """nn.DataParallel splits each batch over every visible GPU from this one rank."""
        return max(torch.cuda.device_count(), 1) if self.env.device.type == "cuda" else 1

    def setup_module(self, model: nn.Module) -> nn.Module:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if self.env.device.type != "cuda" or gpus == 0:
            log.warning(
                "strategy=dp: no CUDA GPUs (device %s), so nn.DataParallel runs the whole batch on this "
                "one device — no parallelism. Use strategy=ddp for several CPU ranks.",
                self.env.device,
            )
            return nn.DataParallel(model.to(self.env.device))
        devices = list(range(gpus))
        log.info("strategy=dp: nn.DataParallel over %d GPUs %s, outputs gathered on cuda:0", gpus, devices)
        return nn.DataParallel(model.to(torch.device("cuda", devices[0])), device_ids=devices)
