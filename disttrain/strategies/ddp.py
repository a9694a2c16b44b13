"""DistributedDataParallel: a full replica per rank, gradients all-reduced in buckets."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from disttrain.strategies.base import Strategy
from disttrain.strategies.specs.data_parallel import DDPStrategyConfig

COMM_HOOKS = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}


class DDPStrategy(Strategy):
    cfg: DDPStrategyConfig

    def setup_module(self, model: nn.Module) -> nn.Module:
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
