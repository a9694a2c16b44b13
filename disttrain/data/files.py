"""The user's own arrays: `.npz` (keys x, y), `.pt` (a dict with x, y or a (x, y) tuple), or CSV
(numbers; the label is the last column unless `target_column` says otherwise)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import TensorDataset

FORMATS = (".npz", ".pt", ".csv")


def load_arrays(path: str, x_key: str = "x", y_key: str = "y", target_column: int = -1) -> tuple[Any, Any]:
    file = Path(path)
    suffix = file.suffix.lower()
    if suffix == ".npz":
        with np.load(file) as f:
            return f[x_key], f[y_key]
    if suffix == ".pt":
        from disttrain.safefile import compressed_record

        if why := compressed_record(file):  # a deflated record would inflate in full (a 2 MB file, GBs)
            raise ValueError(f"{file}: {why}")
        obj = torch.load(file, map_location="cpu", weights_only=True)
        return (obj[x_key], obj[y_key]) if isinstance(obj, dict) else (obj[0], obj[1])
    if suffix == ".csv":
        with warnings.catch_warnings():  # an empty file: 0 samples, which the checks name (data.path)
            warnings.filterwarnings("ignore", message="loadtxt: input contained no data")
            table = np.loadtxt(file, delimiter=",", dtype=np.float64, ndmin=2)
        col = target_column % table.shape[1]
        return np.delete(table, col, axis=1), table[:, col]
    raise ValueError(f"data file {file}: unknown format {suffix!r}; use one of {', '.join(FORMATS)}")


def load_files(
    path: str | None,
    targets: str = "classes",
    x_key: str = "x",
    y_key: str = "y",
    target_column: int = -1,
) -> TensorDataset | None:
    """Features as float32; targets int64 for classes, float32 for values. None: no file."""
    if path is None:
        return None
    x, y = load_arrays(path, x_key, y_key, target_column)
    xt = torch.as_tensor(np.asarray(x), dtype=torch.float32)
    yt = torch.as_tensor(np.asarray(y))
    yt = yt.long() if targets == "classes" else yt.float()
    if len(xt) != len(yt):
        raise ValueError(f"data file {path}: {len(xt)} inputs but {len(yt)} targets")
    return TensorDataset(xt, yt)
