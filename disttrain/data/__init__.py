"""Data sets: built-in ones and the user's own through `data.train._target_`."""

from __future__ import annotations

import pickle
import zipfile
from collections.abc import Mapping
from typing import Any

from disttrain.config.errors import ConfigError
from disttrain.config.instantiate import build
from disttrain.config.schema import Data

# What a missing, unreadable or malformed data file raises while a loader reads it (D11); a
# ValueError too when the loader was given a path (unknown format, inputs and targets differ).
FILE_ERRORS = (OSError, KeyError, EOFError, zipfile.BadZipFile, pickle.UnpicklingError)


def build_datasets(node: Data | Mapping[str, Any]) -> tuple[Any, Any | None]:
    """(train, val) Datasets from the data group; val is None when `data.val` is null."""
    data = Data.of(node)
    train = build(data.train, "data.train", on_error=lambda e: file_error(e, data, "train"))
    val = build(data.val, "data.val", on_error=lambda e: file_error(e, data, "val")) if data.val else None
    return train, val


def file_error(exc: BaseException, data: Data, split: str) -> ConfigError | None:
    """A bad data file as a config error naming the key the user set (data.path, data.val_path)."""
    spec = getattr(data, split)
    path = spec.get("path")
    if not isinstance(exc, FILE_ERRORS) and not (isinstance(exc, ValueError) and path is not None):
        return None
    key = f"data.{split}"
    if path is not None:
        key = next(
            (f"data.{k}" for k in ("path", "val_path") if data.kwargs.get(k) == path), f"data.{split}.path"
        )
    said = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else '(no message)'}"
    if isinstance(exc, KeyError):
        hint = "the file lacks an array the loader reads; write it as np.savez(PATH, x=inputs, y=targets)"
    elif isinstance(exc, FileNotFoundError | IsADirectoryError | NotADirectoryError | PermissionError):
        hint = (
            "check the path (relative to the directory you run disttrain in) and that it is a readable file"
        )
    else:
        hint = "the file is empty, cut short or not in the format its suffix says; write it again"
    allowed = (
        "a token file or a glob of them (raw uint16/uint32 ids: nanoGPT's .bin) for data=tokens"
        if str(spec.get("_target_")).endswith("load_tokens")
        else "a readable data file: .npz (arrays x, y), .pt (dict x, y or a tuple), .csv, or text for data=text"
    )
    return ConfigError(
        key,
        path if path is not None else spec.get("_target_"),
        allowed,
        f"{hint}. The loader {spec.get('_target_')} raised {said}",
    )
