"""DistributedDataParallel: a full replica per rank, gradients all-reduced in buckets."""

from __future__ import annotations

import logging
from typing import Any

from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from disttrain.strategies.base import Strategy
from disttrain.strategies.specs.data_parallel import DDPStrategyConfig

log = logging.getLogger("disttrain")

COMM_HOOKS = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}


class DDPStrategy(Strategy):
    cfg: DDPStrategyConfig

    def setup_module(self, model: nn.Module) -> nn.Module:
        if self.cfg.sync_batchnorm:
            model = sync_batchnorm(model)
        model = model.to(self.env.device)
        on_gpu = self.env.device.type == "cuda"
        ddp = DistributedDataParallel(
            model,
            device_ids=[self.env.device.index] if on_gpu else None,
            bucket_cap_mb=self.cfg.bucket_cap_mb,
            find_unused_parameters=self.cfg.find_unused_parameters,
            static_graph=self.cfg.static_graph,
            gradient_as_bucket_view=self.cfg.gradient_as_bucket_view,
        )
        hook = self.cfg.comm_hook
        if hook:
            ddp.register_comm_hook(state=None, hook=COMM_HOOKS[hook])
        return ddp

    def no_backward_sync(self, model: nn.Module, enabled: bool) -> Any:
        if enabled and isinstance(model, DistributedDataParallel):
            return model.no_sync()
        return super().no_backward_sync(model, enabled)


def sync_batchnorm(model: nn.Module) -> nn.Module:
    """strategy.sync_batchnorm: every BatchNorm layer becomes torch's SyncBatchNorm (batch statistics
    over the ranks' global batch), before DDP wraps the model; said when there is none to convert."""
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    count = sum(isinstance(m, nn.SyncBatchNorm) for m in model.modules())
    if count:
        log.info("strategy.sync_batchnorm: %d BatchNorm layer(s) now SyncBatchNorm", count)
    else:
        log.warning("strategy.sync_batchnorm=true, but the model has no BatchNorm layer: nothing converted")
    return model
