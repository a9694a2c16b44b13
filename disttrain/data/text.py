"""Byte-level language modelling over a text file: (block, block shifted by one) pairs.

The default corpus is `text/python_reference.txt` (the Python 3.11 language reference topics, PSF
License; provenance in text/README.md). Bytes are tokens (vocab 256): no tokenizer, any file works.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

DEFAULT_FILE = Path(__file__).with_name("text") / "python_reference.txt"


class TextBlocks(Dataset):
    """Non-overlapping windows of `block_size + 1` bytes: x = window[:-1], y = window[1:]."""

    def __init__(self, data: torch.Tensor, block_size: int) -> None:
        self.data, self.block_size = data, block_size
        self.n = max(0, (len(data) - 1) // block_size)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.block_size : (i + 1) * self.block_size + 1]
        return chunk[:-1], chunk[1:]


def load_text(
    path: str | None = None, block_size: int = 64, split: str = "train", val_fraction: float = 0.1
) -> TextBlocks:
    """The first 1 - val_fraction of the file trains, the rest validates (contiguous, no leakage)."""
    if split not in ("train", "val"):
        raise ValueError(f"data split={split!r}: choose train or val")
    file = Path(path) if path else DEFAULT_FILE
    raw = torch.from_numpy(np.frombuffer(file.read_bytes(), dtype=np.uint8).astype(np.int64))
    cut = int(len(raw) * (1.0 - val_fraction))
    return TextBlocks(raw[:cut] if split == "train" else raw[cut:], block_size)
