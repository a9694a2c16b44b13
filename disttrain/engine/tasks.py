"""What a batch means: the loss to minimise and the metrics to report, per task."""

from __future__ import annotations

import math

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

    def derived(self, values: dict[str, float]) -> dict[str, float]:
        """Metrics computed from the reduced ones (perplexity from the mean loss)."""
        return {}

    def tokens(self, target: torch.Tensor) -> int:
        """Tokens in a batch, for tokens/s (0: not a sequence task)."""
        return 0


class RegressionTask(Task):
    """Regression: mean squared error; the reported metric is the MSE itself."""

    metric = "mse"

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(output, target)

    def correct(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        per_sample = F.mse_loss(output, target, reduction="none").reshape(len(target), -1).mean(dim=1)
        return per_sample.sum().to(torch.float64)


class LMTask(Task):
    """Language modelling: cross-entropy per token over (batch, time, vocab) logits; the metric is
    next-token accuracy (per sample: the mean over its tokens); perplexity = exp(mean loss)."""

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.flatten(0, -2).float(), target.flatten())

    def correct(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        hits = (output.argmax(dim=-1) == target).to(torch.float64)
        return hits.reshape(len(target), -1).mean(dim=1).sum()

    def derived(self, values: dict[str, float]) -> dict[str, float]:
        out = {}
        for key in ("val/loss", "train/loss"):
            if key in values:
                out[key.replace("loss", "ppl")] = math.exp(min(values[key], 50.0))
        return out

    def tokens(self, target: torch.Tensor) -> int:
        return target.numel()


TASKS = {"classification": Task, "regression": RegressionTask, "lm": LMTask}


def build_task(name: str) -> Task:
    return TASKS[name]()
