"""Watching a validation metric: early stopping and the K best checkpoints.

Both read the values `validate` returns, which are already reduced across ranks: every rank sees
the same floats and so takes the same decisions (stop here, save a best checkpoint here) without a
collective of its own. What they remember lives in TrainState (`watch`, `best`), which goes into
each checkpoint's meta.json: a resumed run keeps its patience count and its best K, and the
Checkpointer reads `best` to spare those checkpoints from keep-N and to point `checkpoints/best`.
"""

from __future__ import annotations

import math
from typing import Any

from disttrain.config.errors import ConfigError
from disttrain.config.schema import CheckpointConfig, EarlyStopConfig
from disttrain.engine.state import TrainState


class Monitoring:
    def __init__(self, stop: EarlyStopConfig, ckpt: CheckpointConfig, state: TrainState) -> None:
        self.stop, self.state = stop, state
        self.keep_best = ckpt.keep_best
        self.best_monitor = ckpt.monitor or stop.monitor
        self.best_mode = ckpt.mode or stop.mode

    @property
    def stopped(self) -> str | None:
        """Why this run stopped early (it, or the run it resumed from), while early stopping is on."""
        reason = self.state.watch.get("stopped")
        return str(reason) if reason and self.stop.patience > 0 else None

    def after_validation(self, step: int, values: dict[str, float]) -> tuple[bool, str | None]:
        """(save a best checkpoint at this step, the reason to stop now or None)."""
        return self._rank_best(step, values), self._watch(step, values)

    def _watch(self, step: int, values: dict[str, float]) -> str | None:
        s = self.stop
        if s.patience <= 0:
            return None
        value = _value(values, s.monitor, "trainer.early_stop.monitor")
        w = self.state.watch
        if "best" not in w or _better(value, float(w["best"]), s.mode, s.min_delta):
            self.state.watch = {"best": value, "step": step, "bad": 0}
            return None
        w["bad"] = int(w["bad"]) + 1
        if w["bad"] < s.patience:
            return None
        delta = f" by more than min_delta={s.min_delta:g}" if s.min_delta else ""
        reason = (
            f"{s.monitor} did not improve on its best {float(w['best']):.6g} (step {w['step']}){delta} in "
            f"{w['bad']} validation(s) since (trainer.early_stop.patience={s.patience}, mode={s.mode})"
        )
        w["stopped"] = reason
        return reason

    def _rank_best(self, step: int, values: dict[str, float]) -> bool:
        if self.keep_best <= 0:
            return False
        value = _value(values, self.best_monitor, "checkpoint.monitor")
        if math.isnan(value):
            return False
        entries = [e for e in self.state.best if int(e[1]) != step]
        entries.append([value, step])
        sign = 1.0 if self.best_mode == "min" else -1.0
        entries.sort(key=lambda e: (sign * float(e[0]), int(e[1])))  # ties: the earlier step first
        self.state.best = entries[: self.keep_best]
        return any(int(e[1]) == step for e in self.state.best)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.stop.patience > 0:
            out["early_stopped"] = self.stopped is not None
            if self.stopped:
                out["stop_reason"] = self.stopped
        if self.keep_best > 0 and self.state.best:
            value, step = self.state.best[0]
            out["best_step"] = int(step)
            out[f"best/{self.best_monitor}"] = float(value)
        return out


def _better(value: float, than: float, mode: str, min_delta: float) -> bool:
    return value < than - min_delta if mode == "min" else value > than + min_delta


def _value(values: dict[str, float], key: str, setting: str) -> float:
    if key not in values:
        raise ConfigError(
            setting,
            key,
            f"a metric the validation reports: {', '.join(sorted(values))}",
            f"set {setting}={next(iter(sorted(values)), 'val/loss')}.",
        )
    return float(values[key])
