"""Throughput numbers for each log step: tokens/s, and for models that know their FLOPs per token
(the built-in GPT) FLOPs per step and MFU against the device's peak (known GPUs only; none on CPU)."""

from __future__ import annotations

from typing import Any

import torch

from disttrain.dist import DistEnv

# dense bf16/fp16 tensor-core peak FLOP/s per device (vendor data sheets, without sparsity)
PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "A10G": 125e12,
    "A10": 125e12,
    "L40S": 362e12,
    "L4": 121e12,
    "V100": 125e12,
    "T4": 65e12,
    "RTX 4090": 165e12,
    "RTX 3090": 71e12,
}


def device_peak_flops(device: torch.device) -> float | None:
    """Peak FLOP/s of one device, or None when it is not in the table (and always on CPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peak in PEAK_FLOPS.items():
        if key in name:
            return peak
    return None


class Throughput:
    def __init__(self, model: Any, env: DistEnv) -> None:
        fpt = getattr(model, "flops_per_token", None)
        self.flops_per_token: int | None = int(fpt()) if callable(fpt) else None
        self.peak = device_peak_flops(env.device)
        self.world = env.world_size

    def rates(self, tokens: int, elapsed: float, steps: int) -> dict[str, float]:
        """`tokens`: global tokens processed in the window of `steps` optimizer steps."""
        if not tokens:
            return {}
        out = {"tokens_per_s": tokens / max(elapsed, 1e-9)}
        if self.flops_per_token is not None:
            out["flops_per_step"] = float(self.flops_per_token * tokens / max(steps, 1))
            if self.peak:
                out["mfu"] = out["tokens_per_s"] * self.flops_per_token / (self.peak * self.world)
        return out
