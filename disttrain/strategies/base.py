"""The small interface every strategy implements; the engine talks only to this.

Modelled on Lightning Fabric's Strategy: the engine never asks `isinstance(model, DDP)`.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from disttrain.dist import DistEnv

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Strategy:
    """Data-parallel defaults: the whole model on every rank, gradients averaged by the wrapper."""

    name = "base"

    def __init__(self, cfg: dict[str, Any], env: DistEnv) -> None:
        self.cfg = cfg
        self.env = env

    # ---------------------------------------------------------------- setup
    def setup_module(self, model: nn.Module) -> nn.Module:
        return model.to(self.env.device)

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return optimizer

    def unwrap(self, model: nn.Module) -> nn.Module:
        return getattr(model, "module", model)

    # ---------------------------------------------------------------- step
    def no_backward_sync(self, model: nn.Module, enabled: bool) -> Any:
        """Skip the gradient all-reduce inside this context (non-final accumulation micro-steps)."""
        return nullcontext()

    def forward_backward(
        self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn, scale: float
    ) -> torch.Tensor:
        """Forward, loss x `scale` (1/grad_accum), backward; returns the detached scaled loss.

        Strategies that split the model across ranks (pipeline) override this as a whole.
        """
        loss = loss_fn(model(x), y) * scale
        self.backward(loss)
        return loss.detach()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def eval_step(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, task: Any) -> torch.Tensor:
        """[loss x n, metric numerator, n] for one validation batch (float64, on the device)."""
        out = model(x)
        loss = task.loss(out, y).to(torch.float64) * len(y)
        return torch.stack(
            [loss, task.correct(out, y), torch.tensor(float(len(y)), dtype=torch.float64, device=out.device)]
        )

    def clip_grad_norm(self, model: nn.Module, max_norm: float | None) -> torch.Tensor:
        """Clip to `max_norm` (None: only measure) and return the total norm before clipping."""
        params = [p for p in model.parameters() if p.grad is not None]
        if max_norm is None:
            return torch.nn.utils.get_total_norm([p.grad for p in params])  # type: ignore[misc]
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    # ---------------------------------------------------------------- collectives
    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        if not dist.is_initialized() or self.env.world_size == 1:
            return tensor
        tensor = tensor.clone()
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor / self.env.world_size if op == "mean" else tensor

    def barrier(self) -> None:
        if dist.is_initialized() and self.env.world_size > 1:
            dist.barrier()

    # ---------------------------------------------------------------- state
    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The full, unwrapped state dict (CPU tensors), as plain PyTorch would save it."""
        return {k: v.detach().cpu() for k, v in self.unwrap(model).state_dict().items()}

    def local_state_bytes(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
        """Bytes this rank holds in parameters, gradients and optimizer state."""
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        total += sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
        for state in optimizer.state.values():
            total += sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v))
        return total
