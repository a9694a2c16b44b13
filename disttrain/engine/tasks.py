"""What a batch means: the loss to minimise and the metrics to report, per task."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Task:
    """Classification: cross-entropy and accuracy."""

    metric = "acc"

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output, target)

    def correct(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Summed metric numerator over the batch (divided by the sample count later)."""
        return (output.argmax(dim=-1) == target).sum().to(torch.float64)


class RegressionTask(Task):
    """Regression: mean squared error; the reported metric is the MSE itself."""

    metric = "mse"

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(output, target)

    def correct(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        per_sample = F.mse_loss(output, target, reduction="none").reshape(len(target), -1).mean(dim=1)
        return per_sample.sum().to(torch.float64)


def build_task(name: str) -> Task:
    return RegressionTask() if name == "regression" else Task()
