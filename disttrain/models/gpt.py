"""A small decoder-only transformer (GPT-2 shape): embeddings, N pre-norm blocks, tied head.

Splittable for pipeline parallelism (`pipeline_layers`: embed, block.0..N-1, head) and tensor
parallelism (a Megatron plan registered in disttrain.models.parallel; attention reshapes with -1
heads so a rank can hold n_heads / tp of them). Activation checkpointing and regional compile take
its blocks like any model's (disttrain.models.blocks).

Attention projects q, k and v with one fused Linear (`attn.qkv`: one GEMM, one read of the input).
Its output features are ordered head by head, (n_heads, 3, head_dim), as Megatron orders them, so
a column-wise tensor-parallel shard (contiguous rows of the weight) holds whole heads with their
q, k and v. Checkpoints from before the fusion hold `attn.q/k/v`: `fuse_qkv` converts a state dict.
On CUDA, scaled_dot_product_attention prefers cuDNN attention, then FlashAttention (`ATTENTION`);
elsewhere torch chooses.

Packed rows (`data.packing=true`): `forward(idx, position_ids=...)` with positions restarting at
each document; attention then takes a block-diagonal causal mask (a token sees the earlier tokens of
its own document only), so each document's logits are those it has alone.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

# SDPA's backends on CUDA, most preferred first (a backend that cannot take the inputs is skipped):
# cuDNN attention is the fastest on Hopper, FlashAttention-2 elsewhere; math is the last resort.
ATTENTION = [
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]


class Embed(nn.Module):
    def __init__(self, vocab_size: int, block_size: int, dim: int, dropout: float) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, dim)
        self.pos = nn.Embedding(block_size, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device) if position_ids is None else position_ids
        return self.drop(self.tok(idx) + self.pos(pos))


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.head_dim = dim // n_heads
        self.qkv = nn.Linear(dim, 3 * dim)  # output features (n_heads, 3, head_dim): see the docstring
        self.qkv.fused_heads = n_heads  # type: ignore[assignment]  # _init draws it as q, k, v were
        self.proj = nn.Linear(dim, dim)
        self.dropout = dropout

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """`mask`: (b, 1, t, t) bool, True where a query may attend (packed rows); None: causal."""
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism a rank's qkv holds only its share of the heads
        qkv = self.qkv(x).view(b, t, -1, 3, self.head_dim).transpose(1, 2)  # (b, heads, t, 3, hd)
        q, k, v = qkv.unbind(3)
        drop = self.dropout if self.training else 0.0
        causal = mask is None
        if q.is_cuda:
            with sdpa_kernel(ATTENTION, set_priority=True):
                y = F.scaled_dot_product_attention(q, k, v, mask, dropout_p=drop, is_causal=causal)
        else:
            y = F.scaled_dot_product_attention(q, k, v, mask, dropout_p=drop, is_causal=causal)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int, mlp_ratio: int, dropout: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, n_heads, dropout)
        self.fc = nn.Linear(dim, mlp_ratio * dim)
        self.fc_out = nn.Linear(mlp_ratio * dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x), mask))
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

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (b, t, vocab); `position_ids` (b, t): packed rows (see the module docstring)."""
        x = self.embed(input_ids, position_ids)
        mask = None if position_ids is None else document_mask(position_ids)
        for block in self.blocks:
            x = block(x) if mask is None else block(x, mask)
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


def document_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """(b, 1, t, t) bool: query i attends key j when j <= i in the same document (a document
    starts wherever the position does not follow the one before)."""
    first = position_ids[..., :1] - 1  # as transformers' find_packed_sequence_indices reads them
    doc = (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)
    t = position_ids.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=position_ids.device).tril()
    return ((doc.unsqueeze(-1) == doc.unsqueeze(-2)) & causal).unsqueeze(1)


def _init(module: nn.Module) -> None:
    heads = getattr(module, "fused_heads", None)
    if isinstance(module, nn.Linear) and heads:
        # q, k and v drawn one after the other, as the separate projections were, then laid out
        # head by head (fuse_qkv): a seed gives the model it gave before the fusion
        with torch.no_grad():
            w = module.weight
            parts = {n: w.new_empty(w.shape[0] // 3, w.shape[1]).normal_(0.0, 0.02) for n in "qkv"}
            w.copy_(fuse_qkv({f"attn.{n}.weight": t for n, t in parts.items()}, heads)["attn.qkv.weight"])
    elif isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def fuse_qkv(state: dict[str, torch.Tensor], n_heads: int) -> dict[str, torch.Tensor]:
    """A state dict of the gpt from before the fused projection (`attn.q`, `attn.k`, `attn.v`) in
    today's layout (`attn.qkv`, output features ordered (n_heads, 3, head_dim)); other keys as they
    are. E.g. `torch.save(fuse_qkv(torch.load("old.pt", weights_only=True), n_heads=4), "new.pt")`,
    then init.path."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        module, _, leaf = key.rpartition(".")
        parent, _, name = module.rpartition(".")
        if parent.rpartition(".")[2] != "attn" or name not in ("q", "k", "v"):
            out[key] = value
        elif name == "q":
            parts = [state[f"{parent}.{n}.{leaf}"] for n in ("q", "k", "v")]
            heads = [part.reshape(n_heads, -1, *part.shape[1:]) for part in parts]  # (heads, hd[, dim])
            out[f"{parent}.qkv.{leaf}"] = torch.stack(heads, dim=1).reshape(-1, *parts[0].shape[1:])
    return out


def gpt_tp_plan(model: GPT) -> dict[str, Any]:
    """Megatron-style: the fused qkv and fc column-wise, proj and fc_out row-wise; embeddings, norms
    and the (tied) head stay replicated, so every block's output is a full tensor. qkv's output
    features are ordered head by head, so each rank's contiguous rows are whole heads (q, k and v
    of n_heads / tp of them), which is what its attention reshapes with -1 heads."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {}
    for i in range(len(model.blocks)):
        p = f"blocks.{i}"
        for name in ("attn.qkv", "fc"):
            plan[f"{p}.{name}"] = ColwiseParallel()
        for name in ("attn.proj", "fc_out"):
            plan[f"{p}.{name}"] = RowwiseParallel()
    return plan
