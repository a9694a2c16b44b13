"""The 8x8 handwritten digits (UCI ML hand-written digits, CC BY 4.0; the copy scikit-learn bundles).

Shipped as `digits.npz` (1797 images, pixel values 0..16) so no download and no scikit-learn import.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

_FILE = Path(__file__).with_name("digits.npz")


def load_digits(split: str = "train", val_fraction: float = 0.2, seed: int = 0) -> TensorDataset:
    """A fixed, seeded split of the digits; features scaled to [0, 1]."""
    if split not in ("train", "val", "all"):
        raise ValueError(f"data split={split!r}: choose train, val or all")
    with np.load(_FILE) as f:
        x = torch.from_numpy(f["images"].astype(np.float32) / 16.0)
        y = torch.from_numpy(f["labels"].astype(np.int64))
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_val = round(len(y) * val_fraction)
    idx = {"val": order[:n_val], "train": order[n_val:], "all": order}[split]
    return TensorDataset(x[idx], y[idx])
