"""Throughput numbers for each log step: tokens/s, FLOPs per step, achieved TFLOP/s per device and
MFU against the device's peak (known GPUs only; none on CPU).

FLOPs per step come from the model when it knows its FLOPs per token (the built-in GPT: the usual
6N + attention formula), else from torch's `FlopCounterMode` over this run's first optimizer step
(`count_flops`): the real forward and backward of every micro-batch, with the real shapes and
wrapping, counted once on every rank and summed (FSDP computes on full, gathered parameters, so each
rank counts its own work; DTensor ops count at their global shapes, so the ranks of a
tensor-parallel group count the same FLOPs, `Strategy.flops_copies`). Matmuls, convolutions and
attention count; elementwise ops do not (as in every MFU figure).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from disttrain.dist import DistEnv

T = TypeVar("T")

# Dense (no sparsity) bf16/fp16 tensor-core peak FLOP/s of one device, from the vendors' data sheets:
# (model, variant, peak). A device name matches by its words, never by substring ("NVIDIA L40" is
# not an "L4"); a name carrying a variant word (PCIe, NVL) matches only that variant's entry, so an
# "H100 PCIe" never gets the SXM part's peak ("NVIDIA H100 80GB HBM3" is the SXM5 part).
PEAK_FLOPS: tuple[tuple[str, str | None, float], ...] = (
    ("GH200", None, 989e12),  # Grace Hopper: an H100 (96/144 GB HBM3/3e) at SXM clocks
    ("H200", None, 989e12),
    ("H100", "PCIE", 756e12),
    ("H100", "NVL", 835e12),
    ("H100", None, 989e12),
    ("A100", "PCIE", 312e12),
    ("A100", None, 312e12),
    ("A10G", None, 125e12),
    ("A10", None, 125e12),
    ("L40S", None, 362e12),
    ("L40", None, 181e12),
    ("L4", None, 121e12),
    ("V100", None, 125e12),
    ("T4", None, 65e12),
    ("4090", None, 165e12),  # GeForce RTX 4090 (fp32 accumulate)
    ("3090", None, 71e12),
)
VARIANTS = ("PCIE", "NVL")
AMPERE = (8, 0)  # TF32 tensor cores from here on; their dense TF32 peak is half the bf16 one


def _words(name: str) -> set[str]:
    return set(re.split(r"[\s\-_/]+", name.upper()))


def bf16_peak(name: str) -> float | None:
    """Dense bf16 peak FLOP/s of the device called `name` (torch.cuda.get_device_name), or None."""
    words = _words(name)
    variant = next((v for v in VARIANTS if v in words), None)
    for model, kind, peak in PEAK_FLOPS:
        if model in words and kind == variant:
            return peak
    return None


def device_peak_flops(device: torch.device, amp: str = "bf16", tf32: bool = True) -> float | None:
    """Peak FLOP/s of one device for the run's precision, or None (MFU n/a): unknown device, CPU,
    or fp32 matmuls without TF32 tensor cores (amp=off with amp.tf32=false, or before Ampere)."""
    if device.type != "cuda":
        return None
    peak = bf16_peak(torch.cuda.get_device_name(device))
    if peak is None or amp != "off":
        return peak
    if not tf32 or torch.cuda.get_device_capability(device) < AMPERE:
        return None
    return peak / 2


class Throughput:
    def __init__(
        self, model: Any, env: DistEnv, amp: str = "bf16", tf32: bool = True, gpus_per_rank: int = 1
    ) -> None:
        """`gpus_per_rank`: devices one rank drives (strategy=dp: every visible GPU), so MFU
        divides by the GPUs the run uses, not by its ranks."""
        fpt = getattr(model, "flops_per_token", None)
        self.flops_per_token: int | None = int(fpt()) if callable(fpt) else None
        self.peak = device_peak_flops(env.device, amp, tf32)
        self.world = env.world_size * max(gpus_per_rank, 1)
        self.flops_per_step: float | None = None  # counted (`count_flops`) when the model has no formula
        self.last: dict[str, float] = {}  # the last log window's FLOP numbers, for the summary

    @property
    def needs_count(self) -> bool:
        """Whether the next step should be counted: no formula and nothing counted yet."""
        return self.flops_per_token is None and self.flops_per_step is None

    def rates(self, tokens: int, elapsed: float, steps: int, slots: int = 0) -> dict[str, float]:
        """`tokens`: global real tokens trained in the window of `steps` optimizer steps (tokens/s);
        `slots`: the places of their rows, padding included (what the device computed), 0: tokens."""
        out = {"tokens_per_s": tokens / max(elapsed, 1e-9)} if tokens else {}
        per_step = self.flops_per_step
        computed = slots or tokens
        if self.flops_per_token is not None:
            per_step = float(self.flops_per_token * computed / max(steps, 1)) if computed else None
        if per_step:
            per_device = per_step * steps / max(elapsed, 1e-9) / self.world  # achieved FLOP/s per GPU
            out.update(flops_per_step=per_step, tflops=per_device / 1e12)
            if self.peak:
                out["mfu"] = per_device / self.peak
            self.last = {k: out[k] for k in ("flops_per_step", "tflops", "mfu") if k in out}
        return out


def count_flops(step: Callable[[], T]) -> tuple[T, int]:
    """Run `step` under torch's FlopCounterMode: its result and the FLOPs this process computed.

    The step runs eagerly (`torch.compiler.set_stance("force_eager")`): a compiled model or block
    (trainer.compile) would show the counter dynamo's tracing, not the step's ops, so its first
    step is counted as eager and compiles on the next one; the count is the eager model's.

    Only where dynamo is loaded (something was compiled): set_stance imports torch._dynamo and
    torch._inductor, 2-12 CPU-s in every rank of an eager run's first step otherwise."""
    import sys
    from contextlib import nullcontext

    from torch.utils.flop_counter import FlopCounterMode

    eager = torch.compiler.set_stance("force_eager") if "torch._dynamo" in sys.modules else nullcontext()
    with eager, FlopCounterMode(display=False) as counter:
        result = step()
    return result, int(counter.get_total_flops())
