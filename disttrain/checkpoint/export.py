"""Weights for plain PyTorch: a checkpoint's model (or its EMA) loaded into a model, or saved as one
consolidated file (`checkpoint.export_final`)."""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from disttrain.checkpoint.dcp_read import _reader
from disttrain.checkpoint.fallback import choose, load_errors, load_sharded, pruned, why_not
from disttrain.checkpoint.files import save_atomic
from disttrain.safefile import default_mode

log = logging.getLogger("disttrain")


class NoEMA(FileNotFoundError):
    """export --ema of a checkpoint that holds no EMA weights (trainer.ema.decay was off)."""


def ema_names(path: Path) -> list[str]:
    """The names of the EMA weights the checkpoint at `path` holds (`ema.weights.<name>`); NoEMA
    when it holds none."""
    prefix = "ema.weights."
    names = [
        k[len(prefix) :] for k in _reader(path).read_metadata().state_dict_metadata if k.startswith(prefix)
    ]
    if not names:
        raise NoEMA(f"checkpoint {path} holds no EMA weights (the run had trainer.ema.decay unset)")
    return names


def ema_entries(path: Path, model_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Empty tensors for the EMA weights the checkpoint at `path` holds, to load them into."""
    return {n: torch.empty_like(model_state[n]) for n in ema_names(path) if n in model_state}


def load_model(
    location: Path,
    model: torch.nn.Module,
    verify: str = "hash",
    ema: bool = False,
    trainable_only: bool = False,
) -> Path:
    """Load the newest whole checkpoint at `location` into the plain `model` in one process; returns
    it. DCP reads each saved shard (an fsdp/tp run's, rank by rank) into its slice of the model's own
    tensors, in place: the shards are gathered into the model, not into a second copy of it.
    `ema`: then the averaged weights (trainer.ema) over the trained ones (NoEMA when there are none).
    `trainable_only` (peft=lora): the checkpoint holds the model but its frozen parameters, which
    keep the values the model has."""
    import warnings

    frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    failed: list[Path] = []
    while True:
        path = choose(location, verify, skip=failed)
        if path is None:
            raise FileNotFoundError(f"no loadable checkpoint under {location}")
        state: dict[str, Any] = {"model": model.state_dict()}
        if trainable_only:
            state["model"] = {k: v for k, v in state["model"].items() if k not in frozen}
        if ema:
            state["ema"] = {"weights": ema_entries(path, state["model"])}
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
                load_sharded(path, state, rank=0, no_dist=True)
            model.load_state_dict(state["model"], strict=not trainable_only)
            if ema:  # only the averaged names: a tied alias (gpt's head) keeps the shared, averaged tensor
                model.load_state_dict(state["ema"]["weights"], strict=False)
            return path
        except load_errors() as exc:  # a pickle, DCP or shape error the manifest cannot see
            if pruned(path):  # the run is training: keep-N removed it while it was read
                log.info("checkpoint %s was pruned while it was read; taking the next newest", path.name)
            else:
                log.warning(
                    "checkpoint %s is not loadable: %s; falling back to the previous one",
                    path.name,
                    why_not(exc),
                )
            failed.append(path)


def export_model(
    location: Path,
    out: Path,
    model: torch.nn.Module,
    verify: str = "hash",
    metadata: dict[str, str] | None = None,
    ema: bool = False,
) -> Path:
    """Load the newest whole checkpoint at `location` into the plain `model`; save one state dict.
    `ema`: the averaged weights (trainer.ema) in place of the trained ones where the EMA has them.

    `.safetensors` writes a safetensors file through `safetensors.torch.save_model`: a tensor shared
    by several names (tied embeddings) is stored once and `safetensors.torch.load_model` ties it
    back; `metadata` (strings) goes into its header. Anything else is a torch.save file.
    """
    path = load_model(location, model, verify, ema)
    write_model(model, out, path, metadata)
    return path


def write_model(
    model: torch.nn.Module, out: Path, path: Path, metadata: dict[str, str] | None = None
) -> None:
    """`model`'s state dict as one file (see export_model); `path`: the checkpoint it came from."""
    tensors = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".safetensors":
        from safetensors.torch import save_model

        fd, name = tempfile.mkstemp(
            prefix=f".{out.name}.", suffix=".tmp", dir=out.parent
        )  # never a planted link
        os.close(fd)
        tmp = Path(name)
        try:
            save_model(model.cpu(), str(tmp), metadata={"checkpoint": str(path), **(metadata or {})})
            os.chmod(tmp, default_mode())  # mkstemp's 0600 would make the export owner-only
            os.replace(tmp, out)
        finally:
            tmp.unlink(missing_ok=True)
    else:
        save_atomic(tensors, out)
    log.info("exported %s (%d tensors) to %s", path, len(tensors), out)
