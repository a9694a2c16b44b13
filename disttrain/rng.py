"""Every RNG a rank draws from (python, numpy, torch, CUDA), saved per rank with each checkpoint
and set again once the resumed epoch's data iterator exists: the resumed run draws what the
interrupted one would have."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """python, numpy, torch (and this rank's CUDA device) RNG states as plain tensors/tuples
    (weights_only-loadable). Only the rank's own device: a resume that sees fewer GPUs (one per
    task, CUDA_VISIBLE_DEVICES, a reshard onto fewer GPUs) restores what this rank drew from."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(np.asarray(keys, dtype=np.int64)), pos, has_gauss, gauss),
        "torch": torch.get_rng_state(),
    }
    if device is not None and device.type == "cuda" and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device | None = None) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is None or device is None or device.type != "cuda" or not torch.cuda.is_available():
        return
    if isinstance(cuda, list | tuple):  # checkpoints before 2026-11: one state per visible device
        index = torch.cuda.current_device() if device.index is None else device.index
        if index >= len(cuda):
            return  # that device did not exist when it was saved: nothing of this rank's to restore
        cuda = cuda[index]
    torch.cuda.set_rng_state(cuda, device)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
