"""A model's repeated blocks, and what is done to each of them: activation checkpointing and
regional compile (`trainer.activation_checkpointing`, `trainer.compile=regional`).

The blocks are found from the model's structure (`repeated_blocks`), the same for any model: the
built-in gpt's `Block`, nanoGPT's `Block`, HF's `GPT2Block`/`LlamaDecoderLayer`, x-transformers'
attention and feed-forward. FSDP makes each of them a unit (`strategies/fsdp.py`).

Neither changes a parameter's name, so state dicts and checkpoints are those of the plain model:

- checkpointing sets the block instance's own `forward` to a wrapper that runs the class's
  forward under `torch.utils.checkpoint` (non-reentrant, RNG state preserved: the same dropout
  masks on recompute); a transformers layer gets the same function through its own switch. No
  wrapper module (torch's `checkpoint_wrapper` renames every parameter under
  `_checkpoint_wrapped_module.`); the class and torch stay as they are.
- regional compile is `nn.Module.compile()` on each block, in place (as torchtitan does), before
  the strategy wraps it: one graph serves every block of a class.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)

from disttrain.models.parallel import has_forward

log = logging.getLogger("disttrain")

# Containers hold modules but run none: FSDP2 refuses them (no forward of their own to hook).
CONTAINERS = (nn.ModuleList, nn.ModuleDict)
# A repeated class whose instances hold < 1/TINY_SHARE of the largest repeated class's parameters
# (x-transformers' per-layer norms beside its attention and feed-forward) is no block of its own.
TINY_SHARE = 8


def _is_list(module: nn.Module) -> bool:
    """A list of layers: ModuleList, Sequential, or a ModuleDict keyed "0", "1", ... (torchtitan)."""
    if isinstance(module, nn.ModuleDict):
        return all(key.isdigit() for key in module)
    return isinstance(module, (nn.ModuleList, nn.Sequential))


def _items(container: nn.Module) -> Iterator[nn.Module]:
    """The layers of a list, looking through nested lists (x-transformers nests one per layer)."""
    for child in container.children():
        if _is_list(child) or isinstance(child, CONTAINERS):
            yield from _items(child)
        else:
            yield child


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: items of its layer lists whose class occurs >= 2 times among the
    items of one list, that run a forward and hold parameters (HF `layer`/`h`, timm `blocks`,
    nanoGPT `h`, torchtitan `layers`, x-transformers' attention and feed-forward). Items of a class
    much smaller than the largest such class are left out (see TINY_SHARE)."""
    found: dict[type, dict[int, nn.Module]] = {}
    for module in model.modules():
        if not _is_list(module):
            continue
        by_class: dict[type, dict[int, nn.Module]] = {}
        for item in _items(module):
            if has_forward(item) and any(True for _ in item.parameters()):
                by_class.setdefault(type(item), {})[id(item)] = item
        for cls, items in by_class.items():
            if len(items) >= 2:
                found.setdefault(cls, {}).update(items)
    if not found:
        return []
    size = {cls: _numel(items.values()) / len(items) for cls, items in found.items()}
    largest = max(size.values())
    return [m for cls, items in found.items() if size[cls] * TINY_SHARE >= largest for m in items.values()]


def _numel(modules: Iterable[nn.Module]) -> int:
    return sum(p.numel() for m in modules for p in m.parameters())


def outer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks not inside another one (where blocks nest, the outer one is the region),
    in the model's module order."""
    blocks = {id(m) for m in repeated_blocks(model)}
    chosen: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        if id(module) in blocks:
            chosen.append(module)
            return
        for child in module.children():
            visit(child)

    visit(model)
    return chosen


def describe(blocks: list[nn.Module]) -> str:
    """What a log line names: "4 blocks (Block)", "4 blocks (Attention x2, FeedForward x2)"."""
    counts = Counter(type(b).__name__ for b in blocks)
    names = ", ".join(name if len(counts) == 1 else f"{name} x{n}" for name, n in sorted(counts.items()))
    return f"{len(blocks)} block{'s' * (len(blocks) != 1)} ({names})"


def no_blocks(model: nn.Module, key: str) -> str:
    """The one line for a model without repeated blocks."""
    return (
        f"{key}: {type(model).__name__} has no repeated block (no layer list holding two or more "
        "modules of one class), so nothing is applied"
    )


# -------------------------------------------------------------------------- activation checkpointing
def _op(path: str) -> Any:
    """torch.ops.<path>, or None where this torch lacks it (a backend's attention kernel)."""
    found: Any = torch.ops
    for part in path.split("."):
        found = getattr(found, part, None)
        if found is None:
            return None
    return found


# Selective checkpointing keeps these ops' outputs and recomputes everything else (norms,
# activations, dropout, residual adds, reshapes): the matmuls and attention that cost the FLOPs,
# the FSDP/TP reduce-scatter that would cost a collective, and max (float8's amax). torchtitan's
# op-level SAC saves the same kind (it also recomputes every second mm; here every matmul is kept).
SAVE_OPS = frozenset(
    op
    for op in map(
        _op,
        (
            "aten.mm.default",
            "aten.addmm.default",
            "aten.bmm.default",
            "aten.baddbmm.default",
            "aten.linear.default",  # a leaf op on some backends (not decomposed into mm)
            "aten.convolution.default",
            "aten._scaled_dot_product_flash_attention.default",
            "aten._scaled_dot_product_flash_attention_for_cpu.default",
            "aten._scaled_dot_product_efficient_attention.default",
            "aten._scaled_dot_product_cudnn_attention.default",
            "aten._scaled_dot_product_fused_attention_overrideable.default",
            "aten.max.default",
            "_c10d_functional.reduce_scatter_tensor.default",
        ),
    )
    if op is not None
)


def _save_matmuls(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if func in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context() -> Any:
    return create_selective_checkpoint_contexts(_save_matmuls)


def _checkpointed(forward: Callable[..., Any], run: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The block's forward under `run` (torch.utils.checkpoint) while autograd records (not in eval
    or no_grad, where nothing is saved anyway)."""
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return run(forward, *args, **kwargs)


def _hf_layer(block: nn.Module) -> bool:
    """A transformers `GradientCheckpointingLayer` (GPT2Block, LlamaDecoderLayer...): it has its own
    switch, which also drops the KV cache that a recompute would append to a second time."""
    return any(cls.__name__ == "GradientCheckpointingLayer" for cls in type(block).__mro__)


def checkpoint_blocks(model: nn.Module, mode: str) -> list[nn.Module]:
    """Recompute each outer repeated block's activations in backward: `full` keeps only the block's
    input, `selective` also the outputs of SAVE_OPS. The blocks it wrapped ([] for "false", or
    when there is none). Parameter names, the class and the state dict are unchanged: the block
    instance's `forward` runs under the checkpoint, or, for a transformers layer, its own switch
    (`gradient_checkpointing`, `_gradient_checkpointing_func`, what `gradient_checkpointing_enable`
    sets) takes the same checkpoint function."""
    if mode not in ("full", "selective"):
        return []
    context_fn = _selective_context if mode == "selective" else noop_context_fn
    run = functools.partial(checkpoint, use_reentrant=False, context_fn=context_fn)
    blocks = outer_blocks(model)
    for block in blocks:
        if not _hf_layer(block):
            setattr(block, "forward", functools.partial(_checkpointed, block.forward, run))  # noqa: B010
    hf = {id(b) for b in blocks if _hf_layer(b)}
    for module in model.modules():  # the layers and the models above them (GPT2Model drops its cache)
        if (
            hf
            and isinstance(getattr(module, "gradient_checkpointing", None), bool)
            and (id(module) in hf or any(id(m) in hf for m in module.modules()))
        ):
            setattr(module, "gradient_checkpointing", True)  # noqa: B010
            setattr(module, "_gradient_checkpointing_func", run)  # noqa: B010
    return blocks


# -------------------------------------------------------------------------------- regional compile
def compile_blocks(model: nn.Module, backend: str) -> list[nn.Module]:
    """`torch.compile` each outer repeated block in place (`nn.Module.compile`: the module and its
    parameter names stay; its calls go through the compiled graph). Blocks of one class share one
    graph (dynamo guards on the class and the shapes, not on which instance)."""
    blocks = outer_blocks(model)
    for block in blocks:
        block.compile(backend=backend)
    return blocks


def prepare_blocks(
    model: nn.Module, checkpointing: str, compile_mode: str, backend: str, announce: bool
) -> None:
    """trainer.activation_checkpointing, then trainer.compile=regional (torchtitan's order: the
    compiled region holds the checkpoint), on the model before the strategy wraps it; `announce`:
    log which blocks (rank 0), or the one line that there are none."""
    regional = compile_mode == "regional"
    wanted = (
        [f"trainer.activation_checkpointing={checkpointing}"]
        if checkpointing in ("full", "selective")
        else []
    )
    wanted += ["trainer.compile=regional"] if regional else []
    if not wanted:
        return
    blocks = checkpoint_blocks(model, checkpointing)
    if regional:
        blocks = compile_blocks(model, backend)
    if not announce:
        return
    if not blocks:
        log.warning(no_blocks(model, " and ".join(wanted)))
        return
    if checkpointing in ("full", "selective"):
        log.info(
            "trainer.activation_checkpointing=%s: %s recompute in backward", checkpointing, describe(blocks)
        )
    if regional:
        log.info("trainer.compile=regional: torch.compile (%s) of %s", backend, describe(blocks))
