"""Metrics sinks: metrics.jsonl and TensorBoard on rank 0; a no-op object on the other ranks."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


class NullMetrics:
    """What ranks other than 0 get: the engine calls it without asking which rank it is."""

    def log(self, step: int, values: dict[str, float], **extra: Any) -> None:
        pass

    def close(self) -> None:
        pass


class Metrics(NullMetrics):
    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        from disttrain.safefile import open_append

        self._jsonl = open_append(run_dir / "metrics.jsonl")  # a planted symlink fails, not followed
        self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, step: int, values: dict[str, float], **extra: Any) -> None:
        record = {"step": step, "time": round(time.time(), 3), **extra, **values}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        for tag, value in values.items():
            self._tb.add_scalar(tag, value, step)

    def close(self) -> None:
        self._jsonl.close()
        self._tb.flush()
        self._tb.close()


def make_metrics(run_dir: Path, is_zero: bool) -> NullMetrics:
    return Metrics(run_dir) if is_zero else NullMetrics()
