"""Cross-field checks, run in the parent before any rank starts.

`check_static` needs no torch (used by `disttrain config`); `check_runtime` looks at the machine
(GPUs) and builds the data sets and the model on the meta device, so a wrong `_target_`, a data set
too small for the world size, or nccl without a GPU fails in seconds, before a queue wait.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from disttrain import storage
from disttrain.config import extras
from disttrain.config.errors import ConfigError, _show, one_of
from disttrain.config.run import Run
from disttrain.config.schema import Data, Sched
from disttrain.observe.sinks import check_sinks
from disttrain.preflight import launch_checks
from disttrain.storage import is_url
from disttrain.strategies import specs

AMP = {"off": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8": "bfloat16"}  # amp -> amp.dtype
# The ranges of the typed blocks' numbers sit beside their fields (`at_least`, checked as a Run
# types them), the data options' own keys' too (data/specs.py).


def _check_monitoring(run: Run) -> None:
    """trainer.early_stop and checkpoint.keep_best watch a validation metric: its mode, counts and
    a validation set to measure it on (a run without one would never stop or keep a best)."""
    stop, ckpt = run.trainer.early_stop, run.checkpoint
    used = [
        (k, v)
        for k, v in (("trainer.early_stop.patience", stop.patience), ("checkpoint.keep_best", ckpt.keep_best))
        if v
    ]
    for key, monitor in (("trainer.early_stop.monitor", stop.monitor), ("checkpoint.monitor", ckpt.monitor)):
        if used and monitor is not None and not str(monitor).startswith("val/"):
            raise ConfigError(
                key, monitor, "a validation metric: val/loss, val/<the task's metric>", "e.g. val/loss."
            )
    if used and not run.data.val:
        raise ConfigError(
            *used[0],
            "0 for a run without a validation set",
            "it watches a validation metric: configure data.val (data.val_path=FILE for data=files).",
        )


def _check_plugins(run: Run) -> None:
    """The checks a registered task, model or data set declares for its own keys (its spec's
    `check_static`), for the one the run builds."""
    from disttrain.config.registry import check_chosen
    from disttrain.data.specs import DATA
    from disttrain.models.specs import MODELS
    from disttrain.tasks.specs import TASKS

    for registry, key in ((TASKS, "task"), (MODELS, "model"), (DATA, "data")):
        check_chosen(registry, run, key)


def check_static(run: Run) -> None:
    """Checks that need only the resolved config."""
    from disttrain.observe.phases import phase

    phase("checks")  # the world, strategy and launcher names: checked by Run.of
    check_sinks(list(run.observe.sinks))
    extras.check_run(run)  # a tracker, fp8, peft without its package: the install command, before launch
    spec, strategy = specs.get(run.strategy.name), run.strategy
    if spec.check_static is not None:
        spec.check_static(run, strategy)
    launch_checks.check_static(run)  # rendezvous, elastic range, SLURM
    _check_amp(run)
    _check_peft(run)
    _check_trainer(run)
    _check_checkpoint(run)
    _check_plugins(run)
    if run.data.option is not None:
        run.data.option.check_run(run)  # the data option's keys against the trainer and strategy


def _check_amp(run: Run) -> None:
    name, dtype = run.amp.name, run.amp.dtype
    if name not in AMP:
        hint = (
            "amp=bf16 needs no loss scaling; amp=fp16 scales the loss; amp=fp8 runs Linear layers in float8."
        )
        raise ConfigError("amp.name", name, one_of(AMP), hint)
    if dtype != AMP[name]:
        raise ConfigError(
            "amp.dtype", dtype, f"{AMP[name]} with amp={name}", f"choose the amp group: amp={name}."
        )
    spec = specs.get(run.strategy.name)
    if name != "off" and not spec.amp:
        raise ConfigError(
            "amp",
            name,
            f"off with strategy={spec.name}",
            f"mixed precision runs under {', '.join(s.name for s in specs.all() if s.amp)}.",
        )
    if name != "off" and name not in spec.amp:
        allowed = [s.name for s in specs.all() if name in s.amp]
        raise ConfigError(
            "amp",
            name,
            f"{' or '.join(sorted(spec.amp))} or off with strategy={spec.name} ({name}: {', '.join(allowed)})",
            ("use amp=bf16, which needs no loss scaling." if name == "fp16" else "use amp=bf16.")
            if "bf16" in spec.amp
            else "use amp=off.",
        )


def _check_peft(run: Run) -> None:
    from disttrain.models.adapters import check_static as check_adapters

    check_adapters(run.peft, run.strategy.name, [s.name for s in specs.all() if s.peft], run.amp.name)


def _check_debug(run: Run) -> None:
    every, spec = run.debug.check_sync_every, specs.get(run.strategy.name)
    if every and not spec.replicated:
        replicated = ", ".join(s.name for s in specs.all() if s.replicated)
        raise ConfigError(
            "debug.check_sync_every",
            every,
            f"0 with strategy={spec.name} (checksums compare whole replicas: {replicated})",
            "sharded or split models hold different parameters on each rank by design.",
        )


def _check_checkpoint(run: Run) -> None:
    """checkpoint block, resume and restarts: values with what is allowed."""
    import os

    _check_urls(run)  # a blank checkpoint.dir: CheckpointConfig's own check
    resume = run.resume
    if resume not in (None, "auto", "never") and not is_url(resume) and not os.path.exists(str(resume)):
        raise ConfigError(
            "resume",
            resume,
            "auto, null, or an existing checkpoint folder or run dir",
            "resume=auto continues from the run dir's latest checkpoint; `disttrain resume RUN_DIR` too.",
        )
    restarts = run.launcher.max_restarts
    if restarts > 0 and not run.trainer.ckpt_every:
        import logging

        logging.getLogger("disttrain").warning(
            "launcher.max_restarts=%d with trainer.ckpt_every=0: a restart starts again from step 0; "
            "set trainer.ckpt_every to resume from the latest checkpoint",
            restarts,
        )


def _urls(run: Run) -> list[tuple[str, str, bool]]:
    """(key, URL, whether it is written) of every object-store location the run names."""
    return [(key, str(url), key == "checkpoint.dir") for key, url in extras.locations(run) if is_url(url)]


def _check_urls(run: Run) -> None:
    """storage_options' shape, and each URL's scheme, bucket and key (as a local path is checked)."""
    if why := storage.options_problem(run.storage_options):
        raise ConfigError(
            "storage_options",
            run.storage_options,
            f"{{protocol: {{option: value}}}} for {', '.join(storage.SCHEMES)}; it {why}",
            "e.g. storage_options={s3:{endpoint_url:'http://127.0.0.1:9000'}}; or leave it empty and use "
            "the standard environment (AWS_ENDPOINT_URL, AWS_PROFILE, GOOGLE_APPLICATION_CREDENTIALS).",
        )
    for key, url, _ in _urls(run):
        if why := storage.url_problem(url):
            raise ConfigError(
                key, url, "a path, or s3://BUCKET/KEY or gs://BUCKET/KEY", f"{why}; fix the URL."
            )


def _probes_stores(run: Run) -> bool:
    """Whether this machine meets the run's stores as its ranks will (not a Kubernetes pod's)."""
    from disttrain.launch.specs import LAUNCHERS

    return not LAUNCHERS.get(run.launcher.name).own_files


def _probe_stores(run: Run) -> None:
    """Before launch: each object store the run names answers, with these credentials, and holds
    the bucket (checkpoint.dir: takes an object). One paragraph naming the key otherwise. Not for a
    launcher whose nodes have their own environment (a Kubernetes pod's credentials are not this
    machine's): its ranks meet the store first."""
    if not _probes_stores(run):
        return
    storage.configure(run.storage_options)
    for key, url, write in _urls(run):
        storage.probe(key, url, write=write)


def _check_trainer(run: Run) -> None:
    t = run.trainer  # its steps, epochs and clipping: checked beside their fields (TrainerConfig)
    _check_monitoring(run)
    spec = specs.get(run.strategy.name)
    if t.compile and not spec.compile:
        raise ConfigError(
            "trainer.compile",
            t.compile,
            f"false with strategy={spec.name}",
            f"compile works with {', '.join(s.name for s in specs.all() if s.compile)}.",
        )
    if t.oom == "auto_microbatch" and not spec.oom_retry:
        raise ConfigError(
            "trainer.oom",
            "auto_microbatch",
            f"off with strategy={spec.name}; auto_microbatch with "
            f"{', '.join(s.name for s in specs.all() if s.oom_retry)}",
            f"{spec.name} runs collectives inside forward/backward (gradient all-reduce, all-gathers, "
            "activations): a real out-of-memory error there (in backward, or on one rank only) leaves "
            "DDP's reducer mid-reduction or the other ranks waiting in a collective the failed rank "
            "never joins, so a retry fails or hangs. Fit memory instead: a smaller trainer.batch_size "
            "with a larger trainer.grad_accum, trainer.activation_checkpointing=true, amp=bf16, or "
            "strategy=fsdp.",
        )
    _check_debug(run)
    _check_ema(run)


def _check_ema(run: Run) -> None:
    decay, spec = run.trainer.ema.decay, specs.get(run.strategy.name)  # its range: EmaConfig's
    if decay and not spec.ema:
        raise ConfigError(
            "trainer.ema.decay",
            decay,
            f"null with strategy={spec.name}",
            f"EMA works with {', '.join(s.name for s in specs.all() if s.ema)}; or drop trainer.ema.decay.",
        )


def _empty_training_set(data: Data, train: Any) -> None:
    """No training sample at all: name the data key that causes it, not trainer.batch_size."""
    from disttrain.data.text import TextBlocks

    path = data.kwargs.get("path")
    if isinstance(train, TextBlocks):
        size, source = len(train.data), path or "the shipped corpus"
        if size > 1:
            raise ConfigError(
                "data.block_size",
                train.block_size,
                f"<= {size - 1} (the training part of {source} has {size} bytes)",
                "a sample is block_size + 1 bytes: use a shorter block, a longer text or a smaller "
                "data.val_fraction.",
            )
        raise ConfigError(
            "data.path",
            path,
            "a text file whose training part holds at least data.block_size + 1 bytes",
            f"its training part has {size} bytes: is the file empty?",
        )
    if path is not None:
        raise ConfigError(
            "data.path",
            path,
            "a data file with at least one sample",
            "it holds none (an empty .csv, or empty arrays): write the samples into it.",
        )
    knobs = [k for k in ("num_samples", "val_fraction", "block_size") if k in data.kwargs]
    shown = ", ".join(f"data.{k}={_show(data.kwargs[k])}" for k in knobs)
    raise ConfigError(
        "data",
        data.name or "?",
        "a data set with at least one training sample",
        f"it has 0 ({shown or 'see `disttrain config`'}): check what data.train builds.",
    )


def _check_resume_path(run: Run) -> None:
    """An explicit resume=PATH must hold a whole checkpoint: otherwise the run would start over."""
    from disttrain import checkpoint

    resume = run.resume
    if resume in (None, "auto", "never") or (is_url(resume) and not _probes_stores(run)):
        return  # a pod's own credentials reach its store: its ranks check the checkpoint
    if checkpoint.choose(storage.location(resume), "size") is not None:
        return
    raise ConfigError(
        "resume",
        resume,
        "a committed checkpoint folder (step_N/ with manifest.json), or a run dir or checkpoints/ dir "
        "holding one",
        "point at RUN_DIR/checkpoints/step_N or at RUN_DIR; `ls RUN_DIR/checkpoints` lists them.",
    )


def check_runtime(run: Run, launched: Mapping[str, Any] | None = None) -> dict[str, int]:
    """Checks that look at the machine and build data and model; returns data set sizes.
    `launched`: the frozen config.yaml of the run dir that `run` repeats (rerun, resume): a warning
    its launch gave already, on keys that did not change since, is not given again."""
    from disttrain.observe.log import prints_into_log, transformers_quiet
    from disttrain.observe.phases import phase

    # the dry build's prints and transformers' warnings: the ranks print them again, into their logs
    with prints_into_log(), transformers_quiet():
        sizes = _check_runtime(run, launched)
    phase("launch")  # the run dir, its frozen config, the ranks started (disttrain.launch.launch)
    return sizes


def _check_runtime(run: Run, launched: Mapping[str, Any] | None) -> dict[str, int]:
    from disttrain.timing import mark

    mark("runtime_checks_start")
    import torch

    from disttrain.data import build_datasets
    from disttrain.data.streams import is_stream
    from disttrain.observe.phases import phase
    from disttrain.preflight.dry_step import dry_step
    from disttrain.preflight.gpus import check_bf16, check_fp8, check_nccl_ranks
    from disttrain.preflight.model import model_for_checks
    from disttrain.tasks import build_task

    mark("runtime_imports")
    launch_checks.check_runtime(run)
    _probe_stores(run)
    _check_resume_path(run)
    gpus = check_nccl_ranks(run)  # compares what `auto` becomes, not the literal backend name
    check_bf16(run, gpus)
    check_fp8(run, gpus)
    train, val = build_datasets(run.data)
    replicas = specs.layout(run).dp  # ranks that split one model (pipeline, tp) share a batch
    per_step = replicas * run.trainer.batch_size * run.trainer.grad_accum
    streams = _check_streams(run, train, val)
    if not streams and len(train) == 0:
        _empty_training_set(run.data, train)
    if not streams and len(train) < per_step:
        raise ConfigError(
            "trainer.batch_size",
            run.trainer.batch_size,
            f"<= {len(train) // (replicas * run.trainer.grad_accum)} for {len(train)} training samples",
            f"one optimizer step takes {replicas} data-parallel replica(s) x batch_size "
            f"{run.trainer.batch_size} x grad_accum {run.trainer.grad_accum} = {per_step} samples; "
            "lower trainer.batch_size or use fewer ranks.",
        )
    phase("model on meta")
    model = model_for_checks(run.model)  # never loads weights: see disttrain.preflight.model
    if model.meta is not None:
        with torch.device("meta"):
            plain = run.to_dict() if launched is not None else {}
            warn = launched is None or any(plain.get(key) != launched.get(key) for key in WARMUP_KEYS)
            check_optim_runtime(run, model.meta, 1 if streams else len(train) // per_step, warn)
        spec = specs.get(run.strategy.name)
        if spec.check_model is not None:
            spec.check_model(run, run.strategy, model.meta, gpus)
        if run.amp.name == "fp8":
            from disttrain.strategies.float8 import check_model

            check_model(run.amp, model.meta)
        if run.peft.name == "lora":  # every target name reaches a module (without importing peft)
            from disttrain.models.adapters import resolve_targets

            resolve_targets(run.peft, model.meta)
    from disttrain.checkpoint import init_from

    init_from.check(run.init, model.meta)  # init.path: kind, key names and shapes from headers, before launch
    from disttrain.timing import mark

    mark("dry_step_start")
    phase("dry step")
    dry_step(run, lambda: build_task(run.task), model.meta, model.build_cpu, train, val)
    sizes = {} if is_stream(train) else {"train": len(train)}
    if val is not None and not is_stream(val):
        sizes["val"] = len(val)
    return sizes


def _check_streams(run: Run, train: Any, val: Any) -> bool:
    """A stream (IterableDataset) has no length: the run's length is trainer.max_steps, and a
    stream validation set is read for trainer.val_batches batches. True when data.train is one."""
    from disttrain.data.streams import first_samples, is_stream

    if val is not None and is_stream(val) and run.trainer.val_batches is None:
        raise ConfigError(
            "trainer.val_batches",
            None,
            "a number >= 1 with a stream (IterableDataset) data.val",
            f"{type(val).__name__} has no length, and every rank must run the same number of validation "
            "forwards: set e.g. trainer.val_batches=20 (batches per rank), or data.val=null.",
        )
    if not is_stream(train):
        return False
    if run.trainer.max_steps < 1:
        raise ConfigError(
            "trainer.max_steps",
            run.trainer.max_steps,
            "a number >= 1 with a stream (IterableDataset) data.train",
            f"{type(train).__name__} has no length, so trainer.max_epochs cannot say how long to train: "
            "set e.g. trainer.max_steps=1000 (optimizer steps; a stream that ends starts over).",
        )
    if not first_samples(train, 1):
        raise ConfigError(
            "data.train",
            type(train).__name__,
            "a stream that yields at least one sample",
            "iterating it in the launcher gave nothing: check what data.train builds (its files, its "
            "filters); a stream that reads the rank itself sees rank 0 of 1 here.",
        )
    return True


# What the warm-up warning depends on: the schedule and the optimizer steps of the run (the
# trainer's length and batch, the data set's size, the data-parallel degree).
WARMUP_KEYS = ("sched", "trainer", "data", "strategy", "nodes", "nproc_per_node")


def check_optim_runtime(run: Run, model: Any, batches_per_epoch: int, warn: bool = True) -> None:
    """Build the optimizer (with its parameter groups) and the schedule on the meta model: a key the
    optimizer or scheduler class does not take, or a value it rejects, fails here, before launch.
    `warn`: say the warm-up warning (off: the run's launch said it already)."""
    from disttrain.engine.optim import build_optimizer, build_scheduler, total_steps

    optimizer = build_optimizer(run.optim, model, specs.layout(run).dp, checking=True)
    steps = total_steps(run.trainer, max(batches_per_epoch, 1) * run.trainer.grad_accum)
    build_scheduler(run.sched, optimizer, max(steps, 1))
    warning = warmup_warning(run.sched, steps)
    if warning and warn:
        import sys

        sys.stderr.write(f"disttrain: warning: {warning}\n")


def warmup_warning(sched: Sched, steps: int) -> str | None:
    """The built-in schedule's warm-up covering the whole run: the lr only climbs and never decays
    (review 2026-11-28-ux #14: cosine's 20 warm-up steps silently swallowed a 20-step run)."""
    warmup = sched.warmup_steps
    if sched.target is not None or warmup <= 0 or warmup < steps:
        return None
    fix = max(1, steps // 10)
    decays = "" if sched.name == "constant" else " and never decays"
    return (
        f"sched.warmup_steps={warmup} is not shorter than the run ({steps} optimizer steps): the lr "
        f"climbs for the whole run{decays}. "
        f"HINT: sched.warmup_steps={fix} (a tenth of the run), or sched.warmup_steps=0."
    )
