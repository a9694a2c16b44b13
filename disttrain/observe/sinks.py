"""Metric sinks: where rank 0's scalars go besides metrics.jsonl (which is always written).

A sink is any object with this small protocol (a class named by `_target_` in `observe.sinks`):

    open(ctx)                 once, before the first step; `ctx.resume` is what `state()` returned
                              in the checkpoint being resumed (None on a fresh run)
    log_hparams(params)       once per tracker run: the resolved config, flattened
    log(step, values)         scalars at an optimizer step
    state() -> dict           saved with every checkpoint (`meta["trackers"]`): e.g. the run id
    close()

Built in: TensorBoard, CSV, MLflow, WandB (the last two import their package lazily: extras
`disttrain[mlflow]`, `disttrain[wandb]`). A resumed, restarted or requeued run continues the same
tracker run, and what the earlier attempt logged after the checkpoint is replaced, not duplicated
(as metrics.jsonl is truncated to the checkpoint's step).
"""

from __future__ import annotations

import csv
import inspect
import io
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from disttrain.config import fingerprint
from disttrain.config.errors import ConfigError
from disttrain.safefile import open_append, write_text_atomic

log = logging.getLogger("disttrain")

ALIASES = {
    "tensorboard": "disttrain.observe.sinks.TensorBoard",
    "csv": "disttrain.observe.sinks.CSV",
    "mlflow": "disttrain.observe.sinks.MLflow",
    "wandb": "disttrain.observe.sinks.WandB",
}


@dataclass
class SinkContext:
    run_dir: Path
    name: str  # the run's `name`
    config: dict[str, Any]
    resume: dict[str, Any] | None = None  # this sink's state() from the checkpoint resumed (or run dir)
    resume_step: int = 0  # the step resumed from: records after it are replaced
    params: dict[str, str] = field(default_factory=dict)


def flatten(node: Any) -> dict[str, str]:
    """The config as trackers take hyperparameters: dotted keys, string values (lists as JSON)."""
    return {
        k: json.dumps(v) if isinstance(v, (list, type(None), bool)) else str(v)
        for k, v in fingerprint.flatten(node).items()
        if v != {}
    }


# ------------------------------------------------------------------------------------ built-ins
class TensorBoard:
    """RUN_DIR/tensorboard: scalars, and the resolved config as hparams (HParams tab)."""

    def open(self, ctx: SinkContext) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # a resume: TensorBoard hides the earlier attempt's events after the checkpoint's step
        purge = ctx.resume_step + 1 if ctx.resume is not None else None
        self._tb = SummaryWriter(log_dir=str(ctx.run_dir / "tensorboard"), purge_step=purge)
        if ctx.resume is None:
            from torch.utils.tensorboard.summary import hparams

            for event in hparams(ctx.params, {}):
                self._tb._get_file_writer().add_summary(event)

    def log_hparams(self, params: dict[str, str]) -> None:
        pass  # written in open: TensorBoard wants them once, before the scalars

    def log(self, step: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            self._tb.add_scalar(tag, value, step)

    def state(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        self._tb.flush()
        self._tb.close()


def _upto(row: list[str], step: int) -> bool:
    """A whole `step,key,value` row at or before `step` (a row a crash cut short is dropped)."""
    return len(row) == 3 and row[0].isdigit() and int(row[0]) <= step and bool(row[2])


class CSV:
    """RUN_DIR/metrics.csv (or `path`): one row per step and key, `step,key,value`."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path

    def open(self, ctx: SinkContext) -> None:
        path = Path(self.path) if self.path else ctx.run_dir / "metrics.csv"
        if ctx.resume is not None and os.path.lexists(path):
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))  # a planted link: ELOOP
            with open(fd, newline="", encoding="utf-8") as f:
                rows = [
                    r for r in csv.reader(f) if r == ["step", "key", "value"] or _upto(r, ctx.resume_step)
                ]
            buf = io.StringIO(newline="")
            csv.writer(buf).writerows(rows)
            write_text_atomic(path, buf.getvalue())
        fresh = not path.is_file() or path.stat().st_size == 0
        self._file = open_append(path, newline="")  # never through a symlink planted in the run dir
        self._csv = csv.writer(self._file)
        if fresh:
            self._csv.writerow(["step", "key", "value"])

    def log_hparams(self, params: dict[str, str]) -> None:
        pass

    def log(self, step: int, values: dict[str, float]) -> None:
        self._csv.writerows([step, k, repr(float(v))] for k, v in values.items())
        self._file.flush()

    def state(self) -> dict[str, Any]:
        return {"resumable": True}

    def close(self) -> None:
        self._file.close()


class MLflow:
    """A real MLflow run. `tracking_uri`: default $MLFLOW_TRACKING_URI, else file:./mlruns.

    On resume the run id from the checkpoint is reopened; with a file store the metric points the
    earlier attempt logged after the checkpoint are removed first (MLflow's API cannot delete
    points; with a tracking server they stay, and a warning says so).
    """

    def __init__(self, tracking_uri: str | None = None, experiment: str | None = None) -> None:
        self.tracking_uri, self.experiment = tracking_uri, experiment
        self.run_id: str | None = None

    def open(self, ctx: SinkContext) -> None:
        uri = self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or Path("mlruns").resolve().as_uri()
        if uri.startswith("file:") or "://" not in uri:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # chosen explicitly: allow it
        from mlflow.tracking import MlflowClient

        self._client = client = MlflowClient(tracking_uri=uri)
        if ctx.resume and ctx.resume.get("run_id"):
            self.run_id = str(ctx.resume["run_id"])
            self._rewind(uri, ctx.resume_step)
            client.update_run(self.run_id, status="RUNNING")
            log.info("mlflow: continuing run %s at %s after step %d", self.run_id, uri, ctx.resume_step)
            return
        name = self.experiment or ctx.name
        exp = client.get_experiment_by_name(name)
        exp_id = exp.experiment_id if exp is not None else client.create_experiment(name)
        run = client.create_run(
            exp_id, run_name=ctx.run_dir.name, tags={"disttrain.run_dir": str(ctx.run_dir)}
        )
        self.run_id = run.info.run_id
        log.info("mlflow: run %s in experiment %r at %s", self.run_id, name, uri)

    def _rewind(self, uri: str, step: int) -> None:
        run = self._client.get_run(str(self.run_id))
        artifacts = urlparse(run.info.artifact_uri)
        if artifacts.scheme not in ("file", ""):
            log.warning("mlflow: %s cannot delete metric points: those after step %d stay", uri, step)
            return
        metrics = Path(unquote(artifacts.path)).parent / "metrics"
        for path in (p for p in metrics.rglob("*") if p.is_file()) if metrics.is_dir() else []:
            lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
            kept = [ln for ln in lines if ln.split() and int(ln.split()[2]) <= step]
            if not kept:  # an empty metric file is "malformed" to MLflow's file store: every later
                path.unlink()  # update_run/get_run of the run would fail
            elif len(kept) != len(lines):
                path.write_text("".join(kept), encoding="utf-8")

    def log_hparams(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k[:250], v[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):
            self._client.log_batch(str(self.run_id), params=items[i : i + 100])

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, step) for k, v in values.items()]
        self._client.log_batch(str(self.run_id), metrics=metrics)

    def state(self) -> dict[str, Any]:
        return {"run_id": self.run_id}

    def close(self) -> None:
        if self.run_id is not None:
            self._client.set_terminated(self.run_id, "FINISHED")


class WandB:
    """A W&B run (`mode`: online, offline or disabled; default $WANDB_MODE or online). Offline runs
    need no network: `wandb sync RUN_DIR/wandb/offline-run-*` uploads them later. On resume the run
    id from the checkpoint is continued (`resume="allow"`); online, W&B's rewind (`resume_from`)
    replaces what the earlier attempt logged after the checkpoint."""

    def __init__(
        self, project: str | None = None, entity: str | None = None, mode: str | None = None
    ) -> None:
        self.project, self.entity, self.mode = project, entity, mode
        self.run_id: str | None = None

    def open(self, ctx: SinkContext) -> None:
        import wandb

        mode = self.mode or os.environ.get("WANDB_MODE") or "online"
        kwargs: dict[str, Any] = {
            "project": self.project or ctx.name,
            "entity": self.entity,
            "dir": str(ctx.run_dir),
            "mode": mode,
            "config": ctx.config,
            "name": ctx.run_dir.name,
        }
        if ctx.resume and ctx.resume.get("run_id"):
            self.run_id = str(ctx.resume["run_id"])
            if mode == "online" and ctx.resume_step:
                kwargs["resume_from"] = f"{self.run_id}?_step={ctx.resume_step}"
            else:
                kwargs.update(id=self.run_id, resume="allow")
        else:
            self.run_id = uuid.uuid4().hex[:8]
            kwargs["id"] = self.run_id
        self._run = wandb.init(**kwargs)

    def log_hparams(self, params: dict[str, str]) -> None:
        pass  # wandb.init(config=...) recorded the nested config

    def log(self, step: int, values: dict[str, float]) -> None:
        self._run.log(dict(values), step=step)

    def state(self) -> dict[str, Any]:
        return {"run_id": self.run_id}

    def close(self) -> None:
        self._run.finish()


# ------------------------------------------------------------------------------------ config
def _spec(entry: Any, key: str) -> tuple[str, dict[str, Any]]:
    if isinstance(entry, str):
        if entry not in ALIASES:
            raise ConfigError(
                key,
                entry,
                f"one of {', '.join(ALIASES)} or a {{_target_: ...}} dict",
                "e.g. observe.sinks=[tensorboard,csv].",
            )
        return ALIASES[entry], {}
    if not isinstance(entry, dict) or not isinstance(entry.get("_target_"), str):
        raise ConfigError(
            key, entry, "a sink name or a dict with a _target_", "e.g. {_target_: mylab.sinks.Mine}."
        )
    kwargs = {k: v for k, v in entry.items() if k != "_target_"}
    target = str(entry["_target_"])
    return ALIASES.get(target, target), kwargs


def check_sinks(entries: Any) -> None:
    """Static check of `observe.sinks` (`entries`) in the parent: names, importability of built-ins' keys."""
    if not isinstance(entries, list):
        raise ConfigError(
            "observe.sinks", entries, "a list of sinks", "e.g. observe.sinks=[tensorboard,mlflow]."
        )
    for i, entry in enumerate(entries):
        key = f"observe.sinks[{i}]"
        target, kwargs = _spec(entry, key)
        if target.startswith("disttrain.observe.sinks."):
            cls = globals().get(target.rsplit(".", 1)[1])
            if cls is None:
                raise ConfigError(key, target, f"one of {', '.join(ALIASES)}", "check the spelling.")
            allowed = [p for p in inspect.signature(cls).parameters]
            for k in kwargs:
                if k not in allowed:
                    raise ConfigError(
                        f"{key}.{k}",
                        kwargs[k],
                        f"keys of {cls.__name__}: {', '.join(allowed) or 'none'}",
                        "check the spelling.",
                    )


def build_sinks(entries: list[Any]) -> list[Any]:
    """The sinks of `observe.sinks` (`entries`), built."""
    from disttrain.config.instantiate import locate

    sinks = []
    for i, entry in enumerate(entries):
        target, kwargs = _spec(entry, f"observe.sinks[{i}]")
        sinks.append(locate(target, f"observe.sinks[{i}]._target_")(**kwargs))
    return sinks


def sink_key(i: int, sink: Any) -> str:
    return f"{i}:{type(sink).__name__}"
