"""Mixed precision as one object: autocast on the run's device type, and a grad scaler that is a
no-op unless amp=fp16 (nanoGPT's `GradScaler(enabled=dtype == float16)` instead of branches).

fp16 uses dynamic loss scaling: a step whose gradients overflow is skipped and the scale halves;
after `growth_interval` good steps it doubles. Under FSDP the gradients are shards, so the scaler
is the sharded one (it all-reduces "found inf" so every rank skips the same step).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch

from disttrain.config.schema import AmpConfig
from disttrain.config.typed import typed

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Precision:
    def __init__(
        self, cfg: AmpConfig | dict[str, Any] | None, device: torch.device, sharded: bool = False
    ) -> None:
        amp = typed(AmpConfig, cfg) if cfg else AmpConfig()  # the schema holds the defaults
        self.name = amp.name
        self.tf32 = amp.tf32
        self.dtype = DTYPES[amp.dtype]
        self.device_type = device.type
        if device.type == "cuda":
            # fp32 matmuls on TF32 tensor cores (torch's default is full fp32: several times slower on
            # Ampere and newer); CUDA only: the setting also reaches CPU matmuls through oneDNN.
            torch.set_float32_matmul_precision("high" if amp.tf32 else "highest")
        self.enabled = self.name != "off"
        kwargs: dict[str, Any] = {
            "init_scale": float(amp.init_scale),
            "growth_interval": int(amp.growth_interval),
            "enabled": self.name == "fp16",
        }
        if sharded:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler: Any = ShardedGradScaler(device.type, **kwargs)
        else:
            self.scaler = torch.amp.GradScaler(device.type, **kwargs)
        self.skipped: torch.Tensor | int = 0  # on the device: steps whose scale fell (read when logged)

    @property
    def scaling(self) -> bool:
        return bool(self.scaler.is_enabled())

    def autocast(self) -> AbstractContextManager[Any]:
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.enabled)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        scaled: torch.Tensor = self.scaler.scale(loss)
        return scaled

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients by the scale in place, so clipping and norms see true values."""
        self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """optimizer.step() unless the gradients overflowed; update the scale.

        No host sync of its own: `get_scale()` before and after (a sync each) gave way to the scale
        tensors, compared on the device; a step is skipped exactly when the update lowers the scale.
        `_get_scale_async` is torch's own sync-free read of that tensor (private, but GradScaler.step
        itself uses it for fused optimizers, which then skip an overflowing step without a sync)."""
        if not self.scaling:
            optimizer.step()
            return
        before = self.scaler._get_scale_async().clone()
        self.scaler.step(optimizer)
        self.scaler.update()
        self.skipped = self.skipped + (self.scaler._get_scale_async() < before).long()

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for overflowing gradients so far: a host read (log steps only)."""
        return int(self.skipped)

    def scale_value(self) -> float:
        return float(self.scaler.get_scale()) if self.scaling else 1.0
