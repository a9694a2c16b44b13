"""peft=lora: LoRA adapters through Hugging Face PEFT (the optional `peft` extra), on any model.

Each rank applies them in `worker.build_parts` after the model is built and init.path's weights are
loaded into it, before the strategy shards it: PEFT's `get_peft_model` puts a LoRA layer around each
target module and leaves every other parameter frozen (`requires_grad=False`). From there on the
frozen base costs no gradient, no optimizer state (the optimizer gets the trainable parameters only)
and no checkpoint bytes: DCP's `ignore_frozen_params` keeps checkpoints, final.pt and the EMA to
the adapters. The base is recorded in the run dir instead (BASE_RECORD: where it came from and an
xxh3 hash of its tensors), and every later build of the run (a resume, `eval`, `predict`, `export`)
rebuilds it the same way and must find the same hash before it loads the adapters.

Nothing here imports peft (or torch) at module level: the parent's checks run without it (peft
imports transformers, accelerate and torchao: seconds of CPU).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from disttrain.config.errors import ConfigError
from disttrain.config.schema import PeftConfig

if TYPE_CHECKING:  # the parent's static checks import this module torch-free
    import torch
    from torch import nn

log = logging.getLogger("disttrain")

BASE_RECORD = "peft_base.json"
# Known architectures (a Hugging Face config's model_type): their attention and MLP projections.
KNOWN = {
    "gpt2": ("c_attn", "c_proj", "c_fc"),
    "llama": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
}
FAN_IN_FAN_OUT = frozenset({"gpt2"})  # transformers' Conv1D stores its weight as (in, out)
BUILTIN = {"disttrain.models.gpt.GPT": ("qkv", "proj", "fc", "fc_out")}  # the built-in gpt's linears
SHOWN = 6


def enabled(cfg: PeftConfig) -> bool:
    return cfg.name == "lora"


def check_static(cfg: PeftConfig, strategy: str, strategies: list[str], amp: str) -> None:
    """Before launch: the numbers make sense, the strategy can hold adapters (a missing peft
    package: disttrain.config.extras, with the install command)."""
    if not enabled(cfg):
        return
    if cfg.rank < 1:
        raise ConfigError("peft.rank", cfg.rank, "an integer >= 1", "8 or 16 is common.")
    if cfg.alpha <= 0:
        raise ConfigError(
            "peft.alpha", cfg.alpha, "a number > 0", "twice the rank is common (alpha=16, rank=8)."
        )
    if not 0 <= cfg.dropout < 1:
        raise ConfigError("peft.dropout", cfg.dropout, "0 <= dropout < 1", "0.0 or 0.05 is common.")
    if strategy not in strategies:
        raise ConfigError(
            "peft",
            "lora",
            f"none with strategy={strategy}",
            f"LoRA adapters train under {', '.join(strategies)}: PEFT wraps each target layer in a LoRA "
            "layer, which tensor-parallel plans and pipeline stages do not split. Use strategy=fsdp (the "
            "frozen base sharded too), or drop peft=lora.",
        )
    if amp == "fp8":
        raise ConfigError(
            "amp",
            "fp8",
            "off, bf16 or fp16 with peft=lora",
            "float8 Linear layers under LoRA adapters are not supported; use amp=bf16.",
        )


# ------------------------------------------------------------------------------------ targets
def model_type(model: nn.Module) -> str | None:
    mt = getattr(getattr(model, "config", None), "model_type", None)
    return mt if isinstance(mt, str) else None


def matches(name: str, targets: list[str]) -> bool:
    """PEFT's rule for a list of target names: the module's name, or a dotted suffix of it."""
    return any(name == t or name.endswith("." + t) for t in targets)


def default_targets(model: nn.Module) -> tuple[list[str], str]:
    """The target module names for `model` when peft.target_modules is null, and why those."""
    mt = model_type(model)
    if mt in KNOWN:
        return list(KNOWN[mt]), f"{mt}'s attention and MLP projections"
    cls = f"{type(model).__module__}.{type(model).__qualname__}"
    if cls in BUILTIN:
        return list(BUILTIN[cls]), "the built-in gpt's attention and MLP linears"
    from torch import nn

    from disttrain.models.blocks import describe, outer_blocks

    blocks = outer_blocks(model)
    names = {id(m): n for n, m in model.named_modules()}
    inside: dict[str, str] = {}  # full name -> name inside its block
    for block in blocks:
        for rel, m in block.named_modules():
            if rel and isinstance(m, nn.Linear):
                inside[f"{names[id(block)]}.{rel}".lstrip(".")] = rel
    short = sorted(set(inside.values()))
    chosen = {n for n, m in model.named_modules() if matches(n, short)}
    targets = short if chosen == set(inside) else sorted(inside)  # short names would reach further
    return targets, f"every nn.Linear in the repeated blocks ({describe(blocks)})" if blocks else "none"


def resolve_targets(cfg: PeftConfig, model: nn.Module) -> tuple[list[str], str]:
    """peft.target_modules, or the default for `model`; every name must reach a module (PEFT would
    fail in every rank otherwise). Works on a meta model."""
    from torch import nn

    given = list(cfg.target_modules) if cfg.target_modules else None
    targets, why = (given, "peft.target_modules") if given else default_targets(model)
    cls = type(model).__name__
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    example = ", ".join(sorted({n.rsplit(".", 1)[-1] for n in linears})[:SHOWN]) or "none"
    if not targets:
        raise ConfigError(
            "peft.target_modules",
            None,
            "names (or dotted suffixes) of the modules that get LoRA adapters",
            f"{cls} is no known architecture and has no nn.Linear in repeated blocks; name the layers, "
            f"e.g. peft.target_modules=[{example}] (its nn.Linear names).",
        )
    names = [n for n, _ in model.named_modules()]
    unknown = [t for t in targets if not any(matches(n, [t]) for n in names)]
    if unknown:
        raise ConfigError(
            "peft.target_modules",
            targets,
            f"names (or dotted suffixes) of {cls}'s modules",
            f"{', '.join(unknown)} name{'s' * (len(unknown) == 1)} no module of {cls}; its nn.Linear "
            f"layers are called {example}.",
        )
    return targets, why


# ------------------------------------------------------------------------------------ apply
def causal_lm(model: nn.Module) -> bool:
    """A transformers causal LM (PEFT's CAUSAL_LM task: AutoPeftModelForCausalLM loads its folder)."""
    name = type(model).__name__
    return model_type(model) is not None and (name.endswith("ForCausalLM") or name.endswith("LMHeadModel"))


def apply(cfg: PeftConfig, model: nn.Module, announce: bool) -> nn.Module:
    """`model` wrapped by PEFT with LoRA adapters on its target modules (a PeftModel); every other
    parameter frozen. `announce`: the log line of what trains (rank 0)."""
    from peft import LoraConfig, get_peft_model
    from torch import nn

    targets, why = resolve_targets(cfg, model)
    config = LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=targets,
        fan_in_fan_out=model_type(model) in FAN_IN_FAN_OUT,
        task_type="CAUSAL_LM" if causal_lm(model) else None,
    )
    adapted: nn.Module = get_peft_model(model, config)
    if announce:
        trainable, total = counts(adapted)
        wrapped = sum(
            1 for m in adapted.modules() if hasattr(m, "lora_A") and isinstance(m.lora_A, nn.ModuleDict)
        )
        log.info(
            "peft=lora: rank %d, alpha %g, dropout %g on %d modules (%s: %s); %s of %s parameters train (%.2f%%)",
            cfg.rank,
            cfg.alpha,
            cfg.dropout,
            wrapped,
            ", ".join(targets[:SHOWN]) + (f", ... ({len(targets)})" if len(targets) > SHOWN else ""),
            why,
            f"{trainable:,}",
            f"{total:,}",
            100.0 * trainable / max(total, 1),
        )
    return adapted


def counts(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters, each shared parameter once (global sizes for DTensors)."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


# ------------------------------------------------------------------------------------ the base
def fingerprint(tensors: dict[str, torch.Tensor]) -> str:
    """xxh3_64 over the tensors' names, dtypes, shapes and bytes (in the given order)."""
    import torch
    import xxhash

    h = xxhash.xxh3_64()
    for name, t in tensors.items():
        local = getattr(t, "to_local", None)
        t = (local() if callable(local) else t).detach().cpu().contiguous().reshape(-1)
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(t.view(torch.uint8).numpy().data)
    return h.hexdigest()


def frozen(model: nn.Module) -> dict[str, torch.Tensor]:
    """The frozen parameters (this rank's shards of them), by name."""
    return {n: p for n, p in model.named_parameters() if not p.requires_grad}


def base_record(run: Any, model: nn.Module) -> dict[str, Any]:
    """What the run dir keeps of the base the adapters train on (`model`: before the adapters)."""
    from disttrain.models.pretrained import base_folder

    folder = base_folder(run.model)
    return {
        "init_path": run.init.path,
        "model": run.model.get("_target_"),
        "pretrained": str(folder.resolve()) if folder else None,
        "seed": run.seed,
        "params": sum(p.numel() for p in model.parameters()),
        "hash": "xxh3_64:" + fingerprint(model.state_dict()),
    }


def keep_base(path: Path, record: dict[str, Any], write: bool) -> str:
    """Write `record` at `path` when none is there (and `write`); else compare the hashes. The
    refusal (a changed base under the adapters) as text, "" when fine."""
    if path.is_file():
        try:
            kept = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            return f"{path} is unreadable ({type(exc).__name__}: {exc})"
        if isinstance(kept, dict) and kept.get("hash") == record["hash"]:
            return ""
        then = kept.get("hash") if isinstance(kept, dict) else None
        where = record["init_path"] or record["pretrained"] or f"model._target_={record['model']}"
        return (
            f"the base weights ({where}) hash to {record['hash']}, but the adapters were trained on a base "
            f"that hashed to {then} ({path}): the base changed since, and the adapters would sit on other "
            "weights. Put the base back as it was (the record names where it came from)"
        )
    if write:
        from disttrain.safefile import write_atomic

        write_atomic(path, (json.dumps(record, indent=2) + "\n").encode())
    return ""


def merged(model: nn.Module) -> nn.Module:
    """The base model with the adapters folded into its weights (PEFT's merge_and_unload)."""
    out: nn.Module = model.merge_and_unload()  # type: ignore[operator]
    return out
