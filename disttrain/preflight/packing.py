"""Before launch: a model given packed rows keeps attention within each document, or is refused.

The built-in gpt builds a block-diagonal causal mask from `position_ids`; a transformers model does
the same (`masking_utils.find_packed_sequence_indices`) when it takes `position_ids` and its
attention implementation reads the mask (sdpa, eager, flex; flash-attention-2 by cu_seqlens). A
model without `position_ids` cannot be told where documents start; one that takes them but attends
across documents anyway (an older or custom attention) is caught by running it: the logits of a
document packed after another must equal its logits alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from disttrain.config.errors import ConfigError
from disttrain.data.packing import is_packed
from disttrain.tasks.builtin import call_model, forward_parameters

if TYPE_CHECKING:
    from disttrain.config.run import Run

TOLERANCE = 1e-4  # float32 on the CPU: the same sums in another order differ by ~1e-7
ALLOWED = (
    "a model that keeps attention within each document of a packed row: the built-in gpt, or a "
    "transformers model that reads documents from position_ids (GPT-2, Llama, Qwen, Mistral ... with "
    "attn_implementation sdpa, eager, flex_attention or flash_attention_2)"
)


def _refuse(run: Run, model: nn.Module, why: str) -> ConfigError:
    key = "packing" if run.data.kwargs.get("packing") else "tokenizer"
    return ConfigError(
        f"data.{key}",
        run.data.kwargs.get(key),
        ALLOWED,
        f"{type(model).__name__} {why}; set data.packing=false (each document padded to its own row), "
        "or use a model that takes position_ids.",
    )


def check_model(run: Run, model: nn.Module, batch: Any) -> None:
    """The static half (any device, meta too): packed rows need a model taking position_ids."""
    if is_packed(batch) and "position_ids" not in forward_parameters(model):
        raise _refuse(run, model, "takes no position_ids argument: it cannot tell where documents start")


def check_documents(run: Run, model: nn.Module, batch: Any) -> None:
    """The run half, on the CPU model: two documents of the batch's own tokens packed in one row."""
    if not is_packed(batch):
        return
    ids = batch["input_ids"][0]
    k = min(4, ids.numel() // 2)
    if k < 2:
        return
    first, second = ids[:k], ids[k : 2 * k]
    positions = torch.arange(k)
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            packed = _logits(model, torch.cat([first, second]), torch.cat([positions, positions]))
            alone = _logits(model, second, positions)
    finally:
        model.train(was)
    if packed is None or alone is None:
        return  # the model returns no logits (a loss only): nothing to compare
    diff = float((packed[k:] - alone).abs().max())
    if diff > TOLERANCE:
        raise _refuse(
            run,
            model,
            f"attends across documents: the logits of a document packed after another differ from "
            f"its logits alone by {diff:.2g} (its attention ignores the packed positions)",
        )


def _logits(model: nn.Module, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
    out = call_model(model, {"input_ids": ids[None], "position_ids": positions[None]})
    logits = getattr(out, "logits", out)
    return logits[0].float() if isinstance(logits, torch.Tensor) and logits.dim() == 3 else None
