"""Gaussian class clusters from a fixed seed: a learnable data set of any size, no files."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset


def make_synthetic(
    num_samples: int = 2048,
    num_features: int = 32,
    num_classes: int = 4,
    noise: float = 1.0,
    seed: int = 1234,
    split: str = "train",
    targets: str = "classes",
) -> TensorDataset:
    """Class centres depend only on `seed`; train and val draw different points around them."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(num_classes, num_features, generator=g) * 2.0
    g.manual_seed(seed + {"train": 1, "val": 2}.get(split, 3))
    y = torch.randint(0, num_classes, (num_samples,), generator=g)
    x = centres[y] + noise * torch.randn(num_samples, num_features, generator=g)
    if targets == "values":
        return TensorDataset(x, torch.nn.functional.one_hot(y, num_classes).float())
    return TensorDataset(x, y)
