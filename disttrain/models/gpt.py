"""A small decoder-only transformer (GPT-2 shape): embeddings, N pre-norm blocks, tied head.

Splittable for pipeline parallelism (`pipeline_layers`: embed, block.0..N-1, head) and tensor
parallelism (a Megatron plan registered in disttrain.models.parallel; attention reshapes with -1
heads so a rank can hold n_heads / tp of them). Activation checkpointing and regional compile take
its blocks like any model's (disttrain.models.blocks).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class Embed(nn.Module):
    def __init__(self, vocab_size: int, block_size: int, dim: int, dropout: float) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, dim)
        self.pos = nn.Embedding(block_size, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.drop(self.tok(idx) + self.pos(pos))


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.head_dim = dim // n_heads
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism a rank's q/k/v hold only its share of the heads
        q, k, v = (f(x).view(b, t, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        drop = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=drop, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int, mlp_ratio: int, dropout: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, n_heads, dropout)
        self.fc = nn.Linear(dim, mlp_ratio * dim)
        self.fc_out = nn.Linear(mlp_ratio * dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.fc_out(F.gelu(self.fc(self.ln2(x)))))


class Head(nn.Module):
    def __init__(self, dim: int, vocab_size: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


class GPT(nn.Module):
    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 64,
        dim: int = 64,
        n_layers: int = 2,
        n_heads: int = 4,
        mlp_ratio: int = 4,
        dropout: float = 0.0,
        tie_weights: bool = True,
    ) -> None:
        super().__init__()
        if dim % n_heads:
            raise ValueError(f"model.dim={dim} must be divisible by model.n_heads={n_heads}")
        self.block_size, self.dim, self.n_layers, self.n_heads = block_size, dim, n_layers, n_heads
        self.embed = Embed(vocab_size, block_size, dim, dropout)
        self.blocks = nn.ModuleList(Block(dim, n_heads, mlp_ratio, dropout) for _ in range(n_layers))
        self.head = Head(dim, vocab_size)
        if tie_weights:
            self.head.out.weight = self.embed.tok.weight
        self.apply(_init)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def pipeline_layers(self) -> list[tuple[str, nn.Module]]:
        return [
            ("embed", self.embed),
            *((f"blocks.{i}", b) for i, b in enumerate(self.blocks)),
            ("head", self.head),
        ]

    def flops_per_token(self) -> int:
        """Training FLOPs per token (forward + backward), 6N + attention (PaLM appendix B)."""
        n = sum(p.numel() for p in self.parameters()) - self.embed.pos.weight.numel()
        return 6 * n + 12 * self.n_layers * self.dim * self.block_size


def _init(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def gpt_tp_plan(model: GPT) -> dict[str, Any]:
    """Megatron-style: q, k, v and fc column-wise, proj and fc_out row-wise; embeddings, norms and
    the (tied) head stay replicated, so every block's output is a full tensor."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {}
    for i in range(len(model.blocks)):
        p = f"blocks.{i}"
        for name in ("attn.q", "attn.k", "attn.v", "fc"):
            plan[f"{p}.{name}"] = ColwiseParallel()
        for name in ("attn.proj", "fc_out"):
            plan[f"{p}.{name}"] = RowwiseParallel()
    return plan
