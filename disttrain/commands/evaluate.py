"""`disttrain eval` and `disttrain predict`: a trained model on a data set, without training.

Both take a run dir (its newest whole checkpoint), its checkpoints/ folder or one checkpoint
folder, plus overrides typed as `resume` types them (`nproc_per_node=1`, `strategy=single`: the
checkpoint reshards; `data.val.KEY=VALUE`, or `data.val=FILE` for arrays in the formats data=files
reads). The run's config.yaml stays as it is: the config with the overrides is frozen into a job
folder (`RUN/evals/eval-TIMESTAMP`, holding the ranks' logs), whose ranks the configured launcher
starts with `disttrain.eval_worker` as their entry, exactly as `train` starts its workers.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from disttrain.config.errors import ConfigError
from disttrain.models.adapters import BASE_RECORD
from disttrain.storage import ObjectPath

if TYPE_CHECKING:
    from disttrain.config.run import Run

EVAL_USAGE = """\
usage: disttrain eval RUN_DIR|CHECKPOINT_DIR [key=value ...] [--out FILE] [--ema] [--trust]

Evaluate a run's newest whole checkpoint (or the checkpoint folder named) with the task's own
validation: val/loss and the task's metric over every sample of the validation set, under any
strategy and world size (the checkpoint reshards). Never trains; the run's config.yaml and
checkpoints stay as they are. Prints the metrics and writes them as JSON to RUN_DIR/eval.json, or
to --out FILE. --ema evaluates the moving average of the weights (trainer.ema) instead.

overrides, typed as `disttrain resume` types them:
  nproc_per_node=1 strategy=single     another world size or strategy
  data.val.KEY=VALUE                   a key of the validation set's spec (data.val.path=other.npz)
  data.val=FILE                        another validation file (.npz x/y, .pt, .csv: as data=files)
  trainer.batch_size=256               the per-rank batch of the evaluation

A run dir someone else made (or whose config.yaml changed since disttrain wrote it) is built only
if its `_target_`s are disttrain's and torch's own, or with --trust: its config is code.
"""

PREDICT_USAGE = """\
usage: disttrain predict RUN_DIR|CHECKPOINT_DIR --out FILE [key=value ...] [--ema] [--trust]

Write the model's outputs on every sample of the validation set (or of data.val=FILE), one row
per sample in dataset order, gathered across ranks (each sample once, whatever the world size).
The output is the task's model call (model(x) for the built-in tasks), or your Task's
`predict(model, batch)` method when it has one (a tensor with the batch as first dimension, or a
dict or tuple of them). Never trains.

--out FILE:
  *.jsonl (or any other suffix)   JSON lines: {"index": i, "output": [...]} (a dict: its keys)
  *.pt                            the outputs stacked into one tensor (or a dict of tensors)
  *.npy                           the stacked tensor as a NumPy array

Overrides as for `disttrain eval` (`disttrain eval --help`); --ema and --trust as there.
"""

VAL_FILE_LOADER = "disttrain.data.files.load_files"


def cmd_eval(rest: list[str]) -> int:
    return _command("eval", rest, EVAL_USAGE)


def cmd_predict(rest: list[str]) -> int:
    return _command("predict", rest, PREDICT_USAGE)


def _command(mode: str, rest: list[str], usage: str) -> int:
    if not rest or rest[0] in ("-h", "--help"):
        sys.stdout.write(usage)
        return 0 if rest else 2
    from disttrain.trust import take_trust_flag

    rest, trusted = take_trust_flag(rest)
    ema = "--ema" in rest
    rest = [a for a in rest if a != "--ema"]
    rest, out_arg = take_out_flag(rest, usage)
    if not rest or rest[0].startswith("-") or "=" in rest[0]:
        raise ConfigError(
            "RUN_DIR", rest[0] if rest else "", "a run dir or checkpoint folder first", usage.splitlines()[0]
        )
    if mode == "predict" and out_arg is None:
        raise ConfigError(
            "--out",
            None,
            "a file: .jsonl, .pt or .npy",
            "predict writes one row per sample there, e.g. --out preds.jsonl.",
        )
    run_dir, location = locate(rest[0], usage)
    if location == run_dir:  # the run's checkpoint.dir, which may lie outside the run dir
        from disttrain.rundir import read_config
        from disttrain.shared_dir import checkpoint_dir

        location = checkpoint_dir(read_config(run_dir), run_dir)  # type: ignore[assignment]
    newest = _check_checkpoint(location, rest[0], ema)  # before the checks that build the model and data
    run, overrides = eval_config(run_dir, rest[1:], trusted, mode)
    _check_model_fits(run, newest, rest[0])
    out = _out_path(run_dir, out_arg, mode)
    job_dir = _job_dir(run_dir, mode)
    job = {
        "mode": mode,
        "checkpoint": str(location),
        "out": str(out),
        "ema": ema,
        "result": str(job_dir / "result.json"),  # which checkpoint the ranks loaded, for the last line
        "base": str(run_dir / BASE_RECORD),  # peft=lora: the base the adapters were trained on
    }
    result = launch_job(run, job_dir, overrides, job)
    if result is None:
        return 1
    report(mode, out, result)
    return 0


def take_out_flag(args: list[str], usage: str) -> tuple[list[str], str | None]:
    """`args` without `--out FILE` (or `--out=FILE`), and FILE."""
    kept: list[str] = []
    out: str | None = None
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--out":
            if i + 1 >= len(args):
                raise ConfigError("--out", None, "--out FILE", usage.splitlines()[0])
            out, i = args[i + 1], i + 2
            continue
        if a.startswith("--out="):
            out = a.split("=", 1)[1]
        elif a.startswith("--"):
            raise ConfigError(a, None, "--out FILE, --ema, --trust, --help", usage.splitlines()[0])
        else:
            kept.append(a)
        i += 1
    return kept, out


def locate(given: str, usage: str) -> tuple[Path, Path]:
    """(run dir whose config.yaml describes the model, the checkpoint location the user named)."""
    from disttrain.commands.export import owning_run_dir
    from disttrain.commands.resume import run_dir_arg

    location = Path(given).resolve()
    if not location.is_dir():
        raise ConfigError("RUN_DIR", given, "an existing run dir or checkpoint folder", usage.splitlines()[0])
    return run_dir_arg(str(owning_run_dir(location, given)), usage), location


def eval_config(run_dir: Path, overrides: list[str], trusted: bool, mode: str) -> tuple[Run, list[str]]:
    """The run's saved config with the overrides, checked as `train` checks it (statically and
    on this machine); a run dir someone else made only with --trust (its `_target_`s are code)."""
    from disttrain.commands.resume import apply_overrides
    from disttrain.config.run import Run
    from disttrain.preflight.checks import check_runtime, check_static
    from disttrain.rundir import read_config
    from disttrain.trust import check_trusted

    saved = read_config(run_dir)
    check_trusted(run_dir, saved, trusted)
    val_file = [o for o in overrides if o.startswith("data.val=")]
    rest = [o for o in overrides if not o.startswith("data.val=")]
    cfg = apply_overrides(saved, rest)
    if val_file:  # the whole node replaced, not merged into the run's own validation set
        cfg = {**cfg, "data": {**cfg["data"], "val": _val_spec(val_file[-1].split("=", 1)[1], cfg["data"])}}
    run = Run.of(cfg)
    if not run.data.val:
        raise ConfigError(
            "data.val",
            run.data.val,
            "a validation data set",
            f"the run has none: name one, e.g. `disttrain {mode} {run_dir} data.val=val.npz` (arrays x, y).",
        )
    if run.world.nodes != 1:
        raise ConfigError(
            "nodes",
            run.world.nodes,
            "1 (eval and predict run on this machine)",
            "add nodes=1 (and nproc_per_node=N).",
        )
    from disttrain.strategies import specs

    if mode == "predict" and not specs.get(run.strategy.name).whole_outputs:
        raise ConfigError(
            "strategy",
            run.strategy.name,
            "a strategy whose ranks each produce the whole model's output (single, ddp, fsdp, zero, tp, ...)",
            "the checkpoint reshards: add strategy=fsdp (or strategy=single nproc_per_node=1).",
        )
    run = run.updated(
        {
            "resume": "never",  # the job loads the checkpoint it names, never the job folder's own
            "checkpoint": {"async": False},  # no background-save group for a job that never saves
            "profile": False,
        }
    )
    check_static(run)
    check_runtime(run)
    from disttrain.launch.registry import launcher_for

    if launcher_for(run).scheduler:
        raise ConfigError(
            "launcher",
            run.launcher.name,
            "a launcher that starts ranks on this machine (spawn, torchrun)",
            "add launcher=spawn; inside an allocation run the command on its first node.",
        )
    return run, overrides


def _val_spec(value: str, data: dict[str, Any]) -> dict[str, Any]:
    """`data.val=FILE`: arrays in the formats data=files reads, as that group builds them."""
    if value in ("null", "None", "~", ""):
        raise ConfigError(
            "data.val", value, "a file (.npz x/y, .pt, .csv)", "name a validation file to evaluate on."
        )
    path = Path(value)
    if not path.is_file():
        raise ConfigError(
            "data.val",
            value,
            "an existing file: .npz (arrays x, y), .pt (dict x, y or a tuple) or .csv (label last)",
            "check the path (relative to the directory you run disttrain in); "
            "data.val.KEY=VALUE changes one key of the run's own validation set instead.",
        )
    return {"_target_": VAL_FILE_LOADER, "path": str(path.resolve()), "targets": data["targets"]}


def _check_checkpoint(location: Path | ObjectPath, given: str, ema: bool = False) -> Path | ObjectPath | None:
    """The checkpoint the ranks will load: a checkpoint folder the user named (step_N/) must be
    whole itself (no older one is ever used in its place); a run or checkpoints/ dir gives its newest
    whole one."""
    from disttrain import checkpoint

    if not checkpoint.candidates(location):
        raise ConfigError(
            "RUN_DIR",
            given,
            "a run dir with a committed checkpoint, or a checkpoint folder",
            f"no checkpoint under {location}: train the run first (or resume it until it saves one).",
        )
    named = checkpoint.named(location)
    if named and (why := checkpoint.problem(location, "size")):
        raise ConfigError(
            "RUN_DIR",
            given,
            "a whole checkpoint folder (the one named is used, never an older one in its place)",
            f"{why}. Name another step_N folder, or the run dir for its newest whole checkpoint.",
        )
    newest = checkpoint.choose(location, "size", fallback=not named)
    if ema and newest is not None:
        try:
            checkpoint.ema_names(newest)
        except checkpoint.NoEMA as exc:
            raise ConfigError(
                "--ema",
                True,
                "a checkpoint of a run trained with trainer.ema.decay set",
                f"{exc}; drop --ema.",
            ) from None
    return newest


def _check_model_fits(run: Run, chosen: Path | ObjectPath | None, given: str) -> None:
    """The run's model (on the meta device) and the checkpoint's `model.*` entries (its
    `.metadata`): a key the model has and the checkpoint lacks, or a shape that differs, is one
    paragraph here instead of every rank failing after launch."""
    if chosen is None or run.peft.name == "lora":  # adapters only: the ranks compare them
        return
    from disttrain.checkpoint import init_from
    from disttrain.config.schema import InitConfig
    from disttrain.preflight.model import model_for_checks

    meta = model_for_checks(run.model).meta
    if meta is None:  # a factory that cannot build on meta: the ranks compare
        return
    shapes, ties = init_from.model_layout(meta)
    src = init_from.Source("dcp", chosen)
    try:
        source = init_from.source_shapes(src)
    except (init_from.Pruned, ConfigError):
        return  # pruned meanwhile, or metadata that does not read: the ranks choose again or name it
    m = init_from.match(InitConfig(), shapes, ties, source)
    if m.missing or m.mismatched:
        raise ConfigError(
            "RUN_DIR",
            given,
            "a checkpoint of this run's model (model._target_ of its config.yaml)",
            f"{init_from.report(m, src, len(shapes), unexpected=False)}. The checkpoint was saved from "
            "another model; evaluate it with the run dir that wrote it.",
        )


def _out_path(run_dir: Path, out_arg: str | None, mode: str) -> Path:
    from disttrain.commands.export import check_out

    if out_arg is None:
        from disttrain.rundir import refuse_planted_links

        refuse_planted_links(run_dir, "RUN_DIR")
        out = run_dir / "eval.json"
    else:
        out = Path(out_arg).absolute()
    if out.is_dir():
        raise ConfigError(
            "--out",
            str(out),
            "a file path",
            f"name a file, e.g. --out {out / ('eval.json' if mode == 'eval' else 'preds.jsonl')}.",
        )
    check_out(out, "--out" if out_arg else "RUN_DIR")
    return out


def _job_dir(run_dir: Path, mode: str) -> Path:
    """Where the job's frozen config and rank logs go: RUN/evals/MODE-TIMESTAMP, or a temporary
    folder when the run dir is not ours to write (someone else's run, read-only)."""
    import os
    import tempfile
    import time

    from disttrain.rundir import claim

    evals = run_dir / "evals"
    if os.access(run_dir, os.W_OK) and not evals.is_symlink():
        return claim(evals / f"{mode}-{time.strftime('%Y%m%d-%H%M%S')}")
    return Path(tempfile.mkdtemp(prefix=f"disttrain-{mode}-"))


def launch_job(run: Run, job_dir: Path, overrides: list[str], job: dict[str, Any]) -> dict[str, Any] | None:
    """Freeze `run` into `job_dir` with job.json, start the ranks, wait: what rank 0 wrote."""
    import json

    from disttrain.eval_worker import ENTRY, JOB
    from disttrain.launch import LaunchError, launch
    from disttrain.rundir import command_line, freeze, write_json

    freeze(job_dir, run, overrides, command_line())
    write_json(job_dir / JOB, job)
    out = Path(job["out"])
    before = out.stat().st_mtime_ns if out.is_file() else None
    try:
        launch(run, job_dir, entry=ENTRY)
    except LaunchError as exc:
        sys.stderr.write(f"disttrain: {job['mode']} {exc} (rank logs: {job_dir / 'logs'})\n")
        raise SystemExit(exc.exit_code) from None
    if not out.is_file() or out.stat().st_mtime_ns == before:
        sys.stderr.write(f"disttrain: {job['mode']} wrote nothing to {out} (rank logs: {job_dir / 'logs'})\n")
        return None
    if job["mode"] == "eval":
        result: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
        return result
    loaded = Path(job["result"])
    return {"out": str(out), **(json.loads(loaded.read_text(encoding="utf-8")) if loaded.is_file() else {})}


def report(mode: str, out: Path, result: dict[str, Any]) -> None:
    if mode == "eval":
        values = " ".join(f"{k}={v:.6f}" for k, v in result["metrics"].items()) or "no samples"
        weights = "'s EMA weights" if "weights" in result else ""
        sys.stdout.write(
            f"eval: {Path(result['checkpoint']).name}{weights} (step {result['step']}) on "
            f"{result['world_size']} rank(s): {values} -> {out}\n"
        )
        return
    source = ""
    if "checkpoint" in result:
        weights = "'s EMA weights" if "weights" in result else ""
        source = f" from {Path(result['checkpoint']).name}{weights} (step {result['step']})"
    from disttrain.tools.render import human_bytes

    sys.stdout.write(f"predict: {_rows(out)} rows{source} -> {out} ({human_bytes(out.stat().st_size)})\n")


def _rows(out: Path) -> int:
    """Rows written (samples): lines of a JSONL file, else the first dimension of the array."""
    if out.suffix == ".npy":
        import numpy as np

        return int(np.load(out, mmap_mode="r").shape[0])
    if out.suffix == ".pt":
        import torch

        data = torch.load(out, weights_only=True)
        first = (
            data
            if isinstance(data, torch.Tensor)
            else next(iter(data.values()) if isinstance(data, dict) else iter(data))
        )
        return int(first.shape[0])
    with out.open(encoding="utf-8") as f:
        return sum(1 for line in f if line.strip())
