"""Reference models; the user's own plug in through `model._target_`."""

from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING, Any

from disttrain.config.instantiate import build

if TYPE_CHECKING:  # the model specs beside this package are imported torch-free by the parent
    import torch

log = logging.getLogger("disttrain")


def build_model(spec: dict[str, Any]) -> Any:
    return build(spec, "model")


def to_master_dtype(model: torch.nn.Module, dtype: torch.dtype, say: bool) -> torch.nn.Module:
    """amp.master_dtype: trainable floating parameters of another dtype are cast to `dtype`, tensor
    by tensor, before sharding; the optimizer state and the EMA are built from them later.

    transformers >= 5 loads a bf16 checkpoint's weights as bf16 (`dtype="auto"`): trained as they
    are, the master weights and AdamW's moments would be bf16, and an EMA at decay 0.999 barely
    moves (bf16 resolves ~0.4 %). Frozen parameters (a LoRA's base model) have no optimizer state
    and keep their dtype; the floating buffers follow the parameters when none is left frozen in
    another dtype (BatchNorm's statistics in the weights' dtype). `.data` is swapped in place, so
    tied parameters stay one tensor; meta tensors stay on meta. `say`: rank 0 logs one line with
    the count and the dtypes.
    """
    import torch

    castable = (torch.float32, torch.bfloat16, torch.float16)  # float64, integers: the model's own choice
    cast: Counter[str] = Counter()
    frozen = 0
    with torch.no_grad():
        for p in model.parameters():  # each shared (tied) parameter once
            if p.dtype in castable and p.dtype != dtype:
                if not p.requires_grad:
                    frozen += 1
                    continue
                cast[f"parameters in {_name(p.dtype)}"] += 1
                p.data = p.data.to(dtype)
        done: dict[int, torch.Tensor] = {}
        for module in model.modules() if not frozen else ():
            for key, b in module._buffers.items():
                if b is not None and b.dtype in castable and b.dtype != dtype:
                    if id(b) not in done:
                        cast[f"buffers in {_name(b.dtype)}"] += 1
                        done[id(b)] = b.to(dtype)
                    module._buffers[key] = done[id(b)]
    if cast and say:
        log.info(
            "amp.master_dtype=%s: %s cast to %s (the trained parameters, optimizer state and EMA)%s",
            _name(dtype),
            ", ".join(f"{n} {what}" for what, n in sorted(cast.items(), reverse=True)),
            _name(dtype),
            f"; {frozen} frozen parameters keep their dtype" if frozen else "",
        )
    return model


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
