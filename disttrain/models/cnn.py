"""A small conv net for square single-channel images (the 8x8 digits by default).

Each conv block (conv, norm-free ReLU, optional pool) is one pipeline layer; the classifier's two
Linear layers pair column- then row-wise for tensor parallelism (`tp_plan`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


class ConvBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, pool: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, kernel_size=3, padding=1)
        self.act = nn.ReLU()
        self.pool: nn.Module = nn.MaxPool2d(2) if pool else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.act(self.conv(x)))


class Reshape(nn.Module):
    """Flat features -> (N, 1, side, side) images."""

    def __init__(self, side: int) -> None:
        super().__init__()
        self.side = side

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(len(x), 1, self.side, self.side)


class CNN(nn.Module):
    def __init__(
        self,
        in_features: int = 64,
        num_classes: int = 10,
        channels: list[int] | tuple[int, ...] = (16, 32),
        hidden: int = 64,
    ) -> None:
        super().__init__()
        side = math.isqrt(in_features)
        if side * side != in_features:
            raise ValueError(f"model cnn needs square images: in_features={in_features} is not a square")
        layers: list[nn.Module] = [Reshape(side)]
        c_in = 1
        for c in channels:
            pool = side % 2 == 0 and side > 1
            layers.append(ConvBlock(c_in, c, pool))
            side, c_in = (side // 2 if pool else side), c
        layers += [
            nn.Flatten(),
            nn.Linear(c_in * side * side, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        ]
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def pipeline_layers(self) -> list[tuple[str, nn.Module]]:
        return [(f"layers.{name}", layer) for name, layer in self.layers.named_children()]

    def tp_plan(self) -> dict[str, Any]:
        """The classifier's Linear pair (column, then row); the conv blocks stay replicated."""
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        linears = [f"layers.{n}" for n, m in self.layers.named_children() if isinstance(m, nn.Linear)]
        return {linears[0]: ColwiseParallel(), linears[1]: RowwiseParallel()}
