"""A multi-layer perceptron over flattened inputs; splittable for pipeline and tensor parallelism."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh}


class MLP(nn.Module):
    def __init__(
        self,
        in_features: int,
        num_classes: int,
        hidden: list[int] | tuple[int, ...] = (128, 128),
        dropout: float = 0.0,
        activation: str = "relu",
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"model.activation={activation!r}: choose one of {', '.join(ACTIVATIONS)}")
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for h in hidden:
            layers += [nn.Linear(width, h), ACTIVATIONS[activation]()]
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            width = h
        layers.append(nn.Linear(width, num_classes))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def pipeline_layers(self) -> list[tuple[str, nn.Module]]:
        """Pipeline stages cut this list: `layers.0` (Flatten), `layers.1` (Linear), ... in order."""
        return [(f"layers.{name}", layer) for name, layer in self.layers.named_children()]

    def tp_plan(self) -> dict[str, Any]:
        """Linear layers in column-then-row pairs (one all-reduce per pair, activations stay sharded
        in between); an unpaired last Linear is row-wise on its replicated input. Every output is a
        full tensor, so the loss sees what a single process would."""
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        linears = [f"layers.{n}" for n, m in self.layers.named_children() if isinstance(m, nn.Linear)]
        plan: dict[str, Any] = {}
        for i in range(0, len(linears) - 1, 2):
            plan[linears[i]], plan[linears[i + 1]] = ColwiseParallel(), RowwiseParallel()
        if len(linears) % 2:
            plan[linears[-1]] = RowwiseParallel(input_layouts=Replicate())
        return plan
