"""Rank 0's metrics: metrics.jsonl always, plus the configured sinks (observe.sinks: TensorBoard,
CSV, MLflow, W&B, your own); a no-op object on the other ranks."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from disttrain.observe.log import get_logger
from disttrain.observe.sinks import TRACKERS, SinkContext, build_sinks, flatten, sink_key

log = get_logger()


class NullMetrics:
    """What ranks other than 0 get: the engine calls it without asking which rank it is."""

    def log(self, step: int, values: dict[str, float], **extra: Any) -> None:
        pass

    def tracker_state(self) -> dict[str, Any]:
        """Each sink's state (tracker run ids), saved with every checkpoint as meta["trackers"]."""
        return {}

    def close(self) -> None:
        pass


class Metrics(NullMetrics):
    def __init__(
        self,
        run_dir: Path,
        cfg: dict[str, Any] | None = None,
        resume: dict[str, Any] | None = None,
        resume_step: int = 0,
    ) -> None:
        from disttrain.safefile import open_append

        self._jsonl = open_append(run_dir / "metrics.jsonl")  # a planted symlink fails, not followed
        self.run_dir = run_dir
        cfg = cfg if cfg is not None else {"observe": {"sinks": ["tensorboard"]}}
        self.sinks = build_sinks(cfg)
        params = flatten({k: v for k, v in cfg.items() if k != "observe"})
        for i, sink in enumerate(self.sinks):
            state = (resume or {}).get(sink_key(i, sink))
            ctx = SinkContext(run_dir, str(cfg.get("name", "disttrain")), cfg, state, resume_step, params)
            sink.open(ctx)
            if state is None:
                sink.log_hparams(params)
        from disttrain.rundir import write_json

        write_json(run_dir / TRACKERS, self.tracker_state())

    def log(self, step: int, values: dict[str, float], **extra: Any) -> None:
        record = {"step": step, "time": round(time.time(), 3), **extra, **values}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        for sink in list(self.sinks):
            try:
                sink.log(step, values)
            except Exception as exc:  # a tracker outage must not stop training
                log.warning("metric sink %s failed at step %d (%s): dropped", type(sink).__name__, step, exc)
                self.sinks.remove(sink)

    def tracker_state(self) -> dict[str, Any]:
        return {sink_key(i, s): s.state() for i, s in enumerate(self.sinks)}

    def close(self) -> None:
        self._jsonl.close()
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as exc:
                log.warning("metric sink %s failed to close: %s", type(sink).__name__, exc)


def make_metrics(
    run_dir: Path,
    is_zero: bool,
    cfg: dict[str, Any] | None = None,
    resume: dict[str, Any] | None = None,
    resume_step: int = 0,
) -> NullMetrics:
    return Metrics(run_dir, cfg, resume, resume_step) if is_zero else NullMetrics()


def tracker_resume(run_dir: Path, meta: dict[str, Any] | None) -> tuple[dict[str, Any] | None, int]:
    """Which tracker runs to continue and from which step: the checkpoint's, else (a restart before
    the first checkpoint) the run dir's own trackers.json from step 0, else none (a fresh run)."""
    if meta is not None:
        return meta.get("trackers") or None, int(meta["step"])
    own = run_dir / TRACKERS
    if own.is_file():
        try:
            return json.loads(own.read_text()) or None, 0
        except ValueError:
            return None, 0
    return None, 0
