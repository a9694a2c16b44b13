"""The model the parent's pre-launch checks look at: built so that the checks never change what the
user's factory does, and never load a model's weights in the launcher.

The factory is called once with the meta device as the default device (no memory, no compute).
When it refuses that (`from_pretrained` does: it wants to load weights), the parent does not build
it for real (a 7B model would cost 28 GB of the launcher's RAM): a Hugging Face `from_pretrained`
target is checked through its structure, `from_config(AutoConfig.from_pretrained(path))` on the
meta device; any other factory skips the model checks with one logged line. Either way the ranks
call the factory as written, outside any meta context, and train exactly what it returns.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from disttrain.config.errors import ConfigError
from disttrain.config.instantiate import build, locate

log = logging.getLogger("disttrain")

# from_pretrained's own arguments the model class takes too (the rest are loading-only: device_map...)
FROM_CONFIG_KWARGS = ("dtype", "torch_dtype", "attn_implementation", "trust_remote_code")
_NO_OP_LOAD = "copying from a non-meta parameter in the checkpoint to a meta parameter"


@dataclass
class CheckedModel:
    """`meta`: the model's structure on the meta device, None when it is not knowable without
    weights. `build_cpu`: a CPU build for the dry step, None when one would load weights."""

    meta: nn.Module | None
    build_cpu: Callable[[], nn.Module] | None


class _MetaRefused(Exception):
    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


def model_for_checks(spec: dict[str, Any]) -> CheckedModel:
    """Build `spec` (the model block) for the pre-launch checks; see the module docstring."""
    try:
        with torch.device("meta"), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = build(spec, "model", on_error=_refuse_meta)
    except _MetaRefused as refused:
        return _without_factory(spec, refused.cause)
    except ConfigError:
        raise
    except Exception as exc:  # the factory raised something build() has no paragraph for
        hf = _pretrained_class(spec)
        cause = exc.__cause__ or exc
        raise (_path_error(spec, hf[0], cause) if hf else factory_error(spec, cause)) from None
    loaded = _replay(caught)
    if not isinstance(model, nn.Module):
        raise ConfigError(
            "model._target_",
            spec["_target_"],
            "a class or function that returns a torch.nn.Module",
            f"it returned {type(model).__name__}; return the model itself (e.g. not a (model, tokenizer) pair).",
        )
    tensors = list(itertools.chain(model.parameters(), model.buffers()))
    if loaded or any(not t.is_meta for t in tensors):  # the factory read its own weights file
        log.info(
            "dry step: %s loads its own weights, so the parent runs it only on the meta device and "
            "does not build it again on the CPU",
            spec["_target_"],
        )
        real = bool(tensors) and not any(t.is_meta for t in tensors)  # already whole on the CPU
        return CheckedModel(model, (lambda: model) if real else None)
    return CheckedModel(model, lambda: build(spec, "model"))


def _refuse_meta(exc: BaseException) -> ConfigError | None:
    """A factory that fails only because of the meta device is not the user's mistake."""
    if "meta" in str(exc).lower():
        raise _MetaRefused(exc)
    return None


def _replay(caught: list[warnings.WarningMessage]) -> bool:
    """Re-emit the build's warnings but torch's no-op load into a meta parameter (which tells us the
    factory loaded a state dict: True)."""
    loaded = False
    for w in caught:
        if _NO_OP_LOAD in str(w.message):
            loaded = True
            continue
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return loaded


def factory_error(spec: dict[str, Any], exc: BaseException) -> ConfigError:
    """Any exception from the user's model factory as one paragraph (no traceback)."""
    return ConfigError(
        "model._target_",
        spec.get("_target_"),
        "a class or function that builds the model from the model.* arguments",
        f"it raised {_said(exc)}{_where(exc)}. The pre-launch checks call it once with the meta "
        "device as the default device (torch.device('meta')); check its arguments (`disttrain config` shows "
        "them) and the files it reads.",
    )


def _without_factory(spec: dict[str, Any], cause: BaseException) -> CheckedModel:
    hf = _pretrained_class(spec)
    if hf is None:
        log.warning(
            "model checks skipped: %s cannot be built on the meta device (%s), and the parent does not "
            "load weights; the ranks build it as written",
            spec["_target_"],
            _said(cause),
        )
        return CheckedModel(None, None)
    meta = _from_config(spec, *hf, torch.device("meta"))
    log.info(
        "model checks: %s refuses the meta device; checking its structure (%s.from_config) without weights",
        spec["_target_"],
        hf[0].__name__,
    )
    return CheckedModel(meta, lambda: _from_config(spec, *hf, torch.device("cpu")))


def _pretrained_class(spec: dict[str, Any]) -> tuple[type, bool] | None:
    """(class, is an Auto class) when `_target_` is a Hugging Face `Class.from_pretrained`."""
    fn = locate(spec["_target_"], "model._target_")
    transformers = sys.modules.get("transformers")
    if transformers is None or not inspect.ismethod(fn) or fn.__name__ != "from_pretrained":
        return None
    cls = fn.__self__
    if not isinstance(cls, type):
        return None
    from transformers.models.auto.auto_factory import _BaseAutoModelClass

    if issubclass(cls, _BaseAutoModelClass):
        return cls, True
    return (cls, False) if issubclass(cls, transformers.PreTrainedModel) else None


def _from_config(spec: dict[str, Any], cls: type, auto: bool, device: torch.device) -> nn.Module:
    """The model `cls.from_pretrained(**spec)` would load, random-initialised on `device`: its
    config read from the same path (a few KB), with from_pretrained's config overrides applied."""
    kwargs = {k: v for k, v in spec.items() if not k.startswith("_")}
    args = list(spec.get("_args_") or [])
    path = kwargs.pop("pretrained_model_name_or_path", args[0] if args else None)
    config = kwargs.pop("config", None)
    try:
        if isinstance(config, dict):  # a `_target_` node: a config object, built (no weights)
            config = build(config, "model.config")
        if config is None or isinstance(config, str):
            config_cls: Any = _auto_config() if auto else cls.config_class  # type: ignore[attr-defined]
            config, kwargs = config_cls.from_pretrained(config or path, return_unused_kwargs=True, **kwargs)
        passed = {k: v for k, v in kwargs.items() if k in FROM_CONFIG_KWARGS}
        with torch.device(device):
            if auto:
                return cls.from_config(config, **passed)  # type: ignore[attr-defined]
            model: nn.Module = cls(config)
        dtype = passed["dtype"] if "dtype" in passed else passed.get("torch_dtype")  # HF's kwargs
        if isinstance(dtype, str) and dtype != "auto":
            dtype = getattr(torch, dtype)
        return model.to(dtype) if isinstance(dtype, torch.dtype) else model
    except Exception as exc:
        raise _path_error(spec, cls, exc) from None


def _path_error(spec: dict[str, Any], cls: type, exc: BaseException) -> ConfigError:
    args = list(spec.get("_args_") or [])
    return ConfigError(
        "model.pretrained_model_name_or_path",
        spec.get("pretrained_model_name_or_path", args[0] if args else None),
        "a folder written by save_pretrained (config.json and weights), or a model name in the local cache",
        f"{cls.__name__} raised {_said(exc)}. A relative path is read from the directory you launch in.",
    )


def _where(exc: BaseException) -> str:
    """` (at FILE:LINE)`, the frame that raised: what a traceback would have pointed at."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def _said(exc: BaseException) -> str:
    """`Type: first line` of an exception's message (a paragraph has no room for the rest)."""
    first = str(exc).strip().splitlines()[0].rstrip(".") if str(exc).strip() else "(no message)"
    return f"{type(exc).__name__}: {first[:300]}"


def _auto_config() -> Any:
    from transformers import AutoConfig

    return AutoConfig
