"""Rank 0's metrics: metrics.jsonl always, plus the configured sinks (observe.sinks: TensorBoard,
CSV, MLflow, W&B, your own); a no-op object on the other ranks."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from disttrain.observe.log import get_logger
from disttrain.observe.sinks import SinkContext, build_sinks, flatten, sink_key
from disttrain.rundir import RunDir

if TYPE_CHECKING:
    from disttrain.config.run import Run

log = get_logger()


class NullMetrics:
    """What ranks other than 0 get: the engine calls it without asking which rank it is."""

    def start(self, meta: dict[str, Any] | None = None) -> None:
        """Open the outputs once; `meta`: the checkpoint a run resumed from (None: none)."""

    def log(self, step: int, values: dict[str, float], **extra: Any) -> None:
        pass

    def tracker_state(self) -> dict[str, Any]:
        """Each sink's state (tracker run ids), saved with every checkpoint as meta["trackers"]."""
        return {}

    def close(self) -> None:
        pass


class Metrics(NullMetrics):
    """metrics.jsonl and the sinks. Nothing is opened until `start` (the engine calls it once it
    knows whether it resumed): a resumed run first drops the records past the checkpoint's step and
    continues the checkpoint's tracker runs."""

    def __init__(
        self,
        run_dir: Path,
        run: Run,
        resume: dict[str, Any] | None = None,
        resume_step: int = 0,
        *,
        start: bool = True,
    ) -> None:
        self.run_dir, self.run = run_dir, run
        self.sinks: list[Any] = []
        self._jsonl: Any = None
        if start:
            self._open(resume, resume_step)

    def start(self, meta: dict[str, Any] | None = None) -> None:
        if self._jsonl is not None:
            return
        trackers, from_step = tracker_resume(self.run_dir, meta)
        if meta is not None:
            truncate_metrics(RunDir(self.run_dir).metrics, from_step)
        self._open(trackers, from_step)

    def _open(self, resume: dict[str, Any] | None, resume_step: int) -> None:
        from disttrain.safefile import open_append

        run_dir, run = self.run_dir, self.run
        self._jsonl = open_append(RunDir(run_dir).metrics)  # a planted symlink fails, not followed
        self.sinks = build_sinks(run.observe.sinks)
        plain = run.to_dict()  # what the sinks are handed: the config as config.yaml holds it
        params = flatten({k: v for k, v in plain.items() if k != "observe"})
        for i, sink in enumerate(self.sinks):
            state = (resume or {}).get(sink_key(i, sink))
            ctx = SinkContext(run_dir, run.name, plain, state, resume_step, params)
            sink.open(ctx)
            if state is None:
                sink.log_hparams(params)
        from disttrain.rundir import write_json

        write_json(RunDir(run_dir).trackers, self.tracker_state())

    def log(self, step: int, values: dict[str, float], **extra: Any) -> None:
        if self._jsonl is None:
            self.start()
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
        if self._jsonl is None:
            return
        self._jsonl.close()
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as exc:
                log.warning("metric sink %s failed to close: %s", type(sink).__name__, exc)


def make_metrics(run_dir: Path, is_zero: bool, run: Run) -> NullMetrics:
    """Rank 0's metrics, not yet opened (see Metrics.start); a no-op elsewhere."""
    return Metrics(run_dir, run, start=False) if is_zero else NullMetrics()


def tracker_resume(run_dir: Path, meta: dict[str, Any] | None) -> tuple[dict[str, Any] | None, int]:
    """Which tracker runs to continue and from which step: the checkpoint's, else (a restart before
    the first checkpoint) the run dir's own trackers.json from step 0, else none (a fresh run)."""
    own = _own_trackers(run_dir)
    if meta is not None:
        # Only this run dir's own tracker runs: a new run started from another run's checkpoint
        # (`train resume=PATH`) opens runs of its own instead of rewinding and taking over those.
        saved = meta.get("trackers")
        mine = {k: v for k, v in saved.items() if own.get(k) == v} if isinstance(saved, dict) else {}
        return mine or None, int(meta["step"])
    return own or None, 0


def _own_trackers(run_dir: Path) -> dict[str, Any]:
    """The run dir's trackers.json ({} when absent or not an object of objects)."""
    try:
        data = json.loads(RunDir(run_dir).trackers.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, dict)}


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The records of RUN_DIR/metrics.jsonl, skipping a line a crash cut mid-write."""
    out = []
    try:
        lines = RunDir(run_dir).metrics.read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line cut by a crash mid-write
    return out


def truncate_metrics(path: Path, step: int) -> None:
    """Drop records logged after `step` (the resumed run logs those steps again), and lines a crash
    cut mid-write (they would break every later reader; read_metrics skips them the same way)."""
    if not path.is_file():
        return
    lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    kept = [r for r in read_metrics(path.parent) if isinstance(r, dict) and r.get("step", 0) <= step]
    if len(kept) != len(lines):
        from disttrain.safefile import write_text_atomic

        write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))
