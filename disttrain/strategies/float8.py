"""amp=fp8: float8 matmuls for a model's Linear layers through torchao (the optional `fp8` extra).

torchao's `convert_to_float8_training` swaps each chosen `nn.Linear` for its `Float8Linear` in place.
The weight and bias Parameters move over as they are, so parameter names, and so checkpoints and
init.path sources, stay those of the plain model. It runs after the model is built and before the
strategy shards it; everything else runs under bf16 autocast (amp.dtype).

Chosen (`choose_linears`), as torchtitan's float8 converter chooses:
- plain `nn.Linear` layers (a subclass may add behaviour, its own forward or a parent module that
  reads its weight directly, as nn.MultiheadAttention does: the swap would drop or bypass it);
- whose in and out features are multiples of 16 (float8 tensor cores need that);
- not the output head (`output_head`), nor a Linear whose weight is tied to another module.

Recipes (amp.fp8_recipe, torchao's `Float8LinearConfig.from_recipe_name`): tensorwise, one scale
per tensor; rowwise, one scale per row with power-of-2 scales. Under FSDP (fsdp, hsdp, zero2)
tensorwise weights are cast to float8 before the all-gather (`enable_fsdp_float8_all_gather`,
half of bf16's traffic), and the scales of all of them are computed in one all-reduce after each
optimizer step (`precompute_float8_dynamic_scale_for_fsdp`), as torchao asks. torchao offers
neither for rowwise.

amp.fp8_emulate=true: torchao's emulated float8 matmuls (`emulate=True`): the same casts and
scales, matmuls in high precision. A numerics check on machines without float8 hardware.

Nothing here imports torchao at module level: the parent's checks run without it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from disttrain.config.errors import ConfigError
from disttrain.config.extras import EXTRAS

if TYPE_CHECKING:
    from torch import nn

    from disttrain.config.schema import AmpConfig

INSTALL = EXTRAS["fp8"].install  # pip install 'disttrain[fp8]' (or pip install 'torchao>=0.18')
MULTIPLE = 16  # float8 GEMMs need both dims of the weight to be multiples of 16


@dataclass
class Float8Choice:
    """Which Linear layers of a model amp=fp8 converts, and why the others stay as they are."""

    converted: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)  # module name -> why it stays in bf16
    converted_weights: int = 0  # elements of the converted Linear weights
    linear_weights: int = 0  # elements of every Linear weight


def torchao_missing() -> bool:
    return importlib.util.find_spec("torchao") is None


def check_torchao() -> None:
    """Before launch: amp=fp8 needs torchao installed (found without importing it)."""
    if torchao_missing():
        raise ConfigError(
            "amp",
            "fp8",
            "off, bf16 or fp16 without torchao (float8 training comes from the torchao package, not installed)",
            f"install it: {INSTALL}; or use amp=bf16.",
        )


def output_head(model: nn.Module) -> str | None:
    """The module name of the model's output projection: what `get_output_embeddings()` returns
    (Hugging Face models; None there means the model has no head), else the last nn.Linear the
    model registers (nanoGPT's lm_head, the built-in gpt's head.out, an MLP's classifier)."""
    from torch import nn

    names = {id(m): name for name, m in model.named_modules()}
    get = getattr(model, "get_output_embeddings", None)
    if callable(get):
        head = get()
        return names.get(id(head)) if isinstance(head, nn.Module) else None
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    return linears[-1] if linears else None


def choose_linears(model: nn.Module) -> Float8Choice:
    """The Linear layers amp=fp8 converts (see the module docstring); works on a meta model."""
    from torch import nn

    head = output_head(model)
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    choice = Float8Choice()
    for name, m in model.named_modules():
        if not isinstance(m, nn.Linear):
            continue
        choice.linear_weights += m.weight.numel()
        if type(m) is not nn.Linear:
            why = f"{type(m).__name__}, a subclass of nn.Linear"
        elif name == head:
            why = "the output head"
        elif uses[id(m.weight)] > 1:
            why = "its weight is tied to another module"
        elif m.in_features % MULTIPLE or m.out_features % MULTIPLE:
            why = f"{m.in_features} -> {m.out_features} features, not multiples of {MULTIPLE}"
        else:
            choice.converted.append(name)
            choice.converted_weights += m.weight.numel()
            continue
        choice.kept[name] = why
    return choice


def check_model(amp: AmpConfig, model: nn.Module) -> None:
    """Before launch, on the meta model: amp=fp8 that would convert no layer is a mistake."""
    choice = choose_linears(model)
    if choice.converted:
        return
    kept = "; ".join(f"{name}: {why}" for name, why in list(choice.kept.items())[:4]) or "it has no nn.Linear"
    raise ConfigError(
        "amp",
        amp.name,
        "off, bf16 or fp16 for this model: amp=fp8 converts plain nn.Linear layers whose in and out "
        f"features are multiples of {MULTIPLE}, except the output head, and this model has none ({kept})",
        "use amp=bf16, or widen the layers to multiples of 16.",
    )


def float8_config(amp: AmpConfig, sharded: bool) -> Any:
    """torchao's Float8LinearConfig for the recipe: float8 all-gather under FSDP where torchao
    offers it (tensorwise), emulated matmuls with amp.fp8_emulate."""
    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(str(amp.fp8_recipe))
    return dataclasses.replace(
        config,
        enable_fsdp_float8_all_gather=sharded and amp.fp8_recipe == "tensorwise",
        emulate=bool(amp.fp8_emulate),
    )


@dataclass
class Float8Model:
    """What `convert` did to one model: its layers, and the scale precompute after each step."""

    model: nn.Module
    choice: Float8Choice
    all_gather: bool
    precompute: bool

    def after_step(self) -> None:
        """After the optimizer step, every rank: all float8 weight scales in one all-reduce."""
        if self.precompute:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(self.model)

    def summary(self) -> dict[str, Any]:
        """summary.json: the converted layers, and the share of Linear FLOPs that run in float8
        (a Linear's training FLOPs per token are 6 x its weight's elements)."""
        c = self.choice
        return {
            "fp8_linears": len(c.converted),
            "fp8_linear_flops_share": round(c.converted_weights / max(c.linear_weights, 1), 4),
        }


def convert(model: nn.Module, amp: AmpConfig, sharded: bool, precompute: bool = True) -> Float8Model:
    """Swap the chosen Linear layers for torchao's Float8Linear, in place, before sharding, and
    name them in the log. `sharded`: the strategy is FSDP (float8 all-gather for tensorwise);
    `precompute`: the scales are computed after each optimizer step (not with an EMA, whose
    weights swapped in for validation would meet scales computed from the live ones)."""
    from torchao.float8 import convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    from disttrain.observe.log import get_logger

    choice = choose_linears(model)
    config = float8_config(amp, sharded)
    chosen = set(choice.converted)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda _m, fqn: fqn in chosen)
    swapped = [name for name, m in model.named_modules() if isinstance(m, Float8Linear)]
    if sorted(swapped) != sorted(chosen):  # a torchao that chose by its own rules
        raise RuntimeError(f"amp=fp8: torchao converted {sorted(swapped)}, expected {sorted(chosen)}")
    all_gather = bool(config.enable_fsdp_float8_all_gather)
    done = Float8Model(model, choice, all_gather, precompute=all_gather and precompute)
    how = [str(amp.fp8_recipe)]
    if amp.fp8_emulate:
        how.append("emulated matmuls")
    if all_gather:
        how.append("float8 FSDP all-gather")
    if done.precompute:
        how.append("scales precomputed after each optimizer step")
    get_logger().info(
        "amp=fp8 (%s): %d Linear layers to Float8Linear, %.0f%% of the Linear FLOPs: %s; kept in bf16: %s",
        ", ".join(how),
        len(swapped),
        100 * done.summary()["fp8_linear_flops_share"],
        grouped(choice.converted),
        "; ".join(f"{name} ({why})" for name, why in grouped_kept(choice.kept)) or "none",
    )
    return done


def grouped(names: list[str]) -> str:
    """Module names with their layer indices folded: blocks.*.fc (12), head.out."""
    counts = Counter(re.sub(r"\.\d+(?=\.|$)", ".*", name) for name in names)
    return ", ".join(f"{pattern} ({n})" if n > 1 else pattern for pattern, n in counts.items())


def grouped_kept(kept: dict[str, str]) -> list[tuple[str, str]]:
    """(folded names, why) for the layers left in bf16, one entry per reason."""
    by_why: dict[str, list[str]] = {}
    for name, why in kept.items():
        by_why.setdefault(why, []).append(name)
    return [(grouped(names), why) for why, names in by_why.items()]
