"""The base config a Hugging Face `from_pretrained` run started from, kept in its run dir.

A run whose model is `SomeClass.from_pretrained(FOLDER)` is rebuilt later (export) from FOLDER as
it is then: a changed config.json (a new revision of the base model) would export other code paths
under the trained weights, and a deleted folder would end in a traceback. So the first freeze of
the run dir copies FOLDER's config files into `RUN/base_model/`, and export builds the model from
that copy with `from_config` (random-initialised, then every weight comes from the checkpoint; the
base weights are never read). A run dir frozen before this existed rebuilds from FOLDER's config;
a missing folder is one paragraph naming `model.pretrained_model_name_or_path`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from disttrain.models.pretrained import base_folder

log = logging.getLogger("disttrain")

BASE = "base_model"
FILES = ("config.json", "generation_config.json")
MAX_BYTES = 16 << 20  # a config file; anything larger is not one

__all__ = ["BASE", "base_folder", "build", "record"]


def record(run_dir: Path, spec: dict[str, Any]) -> None:
    """Copy the base folder's config files into `run_dir/base_model/`, once (a resume keeps the
    copy of the run's first launch)."""
    from disttrain.safefile import write_atomic

    folder = base_folder(spec)
    kept = run_dir / BASE
    if folder is None or (kept / "config.json").exists():
        return
    kept.mkdir(exist_ok=True)
    for name in FILES:
        src = folder / name
        if src.is_file() and src.stat().st_size <= MAX_BYTES:
            write_atomic(kept / name, src.read_bytes())


def build(run_dir: Path, spec: dict[str, Any]) -> nn.Module | None:
    """The run's Hugging Face model on the CPU from the config it trained with (`run_dir/base_model`,
    else the base folder's), weights random; None when `spec` is not a `from_pretrained` target.
    A base folder that is gone is a ConfigError naming model.pretrained_model_name_or_path."""
    from disttrain.preflight.model import _from_config, _pretrained_class

    hf = _pretrained_class(spec)
    if hf is None:
        return None
    kept = run_dir / BASE
    if (kept / "config.json").is_file():
        args = list(spec.get("_args_") or [])
        spec = {
            **spec,
            **({"_args_": [str(kept), *args[1:]]} if args else {"pretrained_model_name_or_path": str(kept)}),
        }
        log.info("the model is rebuilt from the base config the run trained with (%s)", kept)
    model = _from_config(spec, *hf, torch.device("cpu"))
    dtype = getattr(getattr(model, "config", None), "dtype", None)  # what from_pretrained's "auto" gives
    if isinstance(dtype, str) and dtype != "auto":
        dtype = getattr(torch, dtype, None)
    if not any(k in spec for k in ("dtype", "torch_dtype")) and isinstance(dtype, torch.dtype):
        model = model.to(dtype)  # an Auto class's from_config did this already; a model class's __init__ not
    return model
