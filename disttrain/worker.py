"""Per-rank entry: the only place that owns the process group.

Every launcher (torchrun, spawn, in-process, already-launched) ends here with a run dir whose
config.yaml was resolved once by the parent; a rank never re-composes or re-resolves the config.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from disttrain import storage
from disttrain.checkpoint import init_from
from disttrain.checkpoint.geometry import checkpoint_meta, keep_global_batch
from disttrain.checkpoint.manager import Checkpointer, ModelState, resume_location, run_info
from disttrain.config.errors import ConfigError
from disttrain.config.run import Run
from disttrain.data import build_datasets
from disttrain.data.loaders import loader_batches, make_loaders
from disttrain.data.streams import LOADER, loader_state
from disttrain.dist import DistEnv, destroy_process_group, init_process_group
from disttrain.engine.ema import build_ema
from disttrain.engine.guards import Guards
from disttrain.engine.loop import Engine, Parts, global_batch, total_steps
from disttrain.engine.optim import build_optimizer, build_scheduler
from disttrain.engine.state import TrainState
from disttrain.launch.forkserver import linger_after_a_peer_died
from disttrain.models import adapters, build_model, to_master_dtype
from disttrain.models.blocks import prepare_blocks
from disttrain.observe.envreport import report_env
from disttrain.observe.log import (
    console,
    console_apart,
    get_logger,
    prints_into_log,
    setup_logging,
    stderr_into_log,
    teardown_logging,
)
from disttrain.observe.metrics import NullMetrics, make_metrics
from disttrain.observe.phases import enter_time, rank_up
from disttrain.observe.profiler import make_profiler
from disttrain.observe.summary import record_summary
from disttrain.owner import rank_lock
from disttrain.procs import launcher_alive, name_process
from disttrain.rng import seed_everything
from disttrain.rundir import RunDir, read_config, record_orphaned, refuse_planted_links
from disttrain.shared_dir import check_shared, checkpoint_dir
from disttrain.strategies import build_strategy, specs
from disttrain.strategies.base import Strategy
from disttrain.strategies.precision import DTYPES
from disttrain.tasks import build_task
from disttrain.timing import mark, mark_process_start

log = get_logger()


def run(run_dir: str | Path) -> dict[str, Any] | None:
    """Train as the rank described by the environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*)."""
    mark_process_start("rank_start")
    mark("rank_imported")
    run_dir = Path(run_dir)
    plain = read_config(run_dir)
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())  # the user's own modules, as in the parent; never ahead of torch
    refuse_planted_links(run_dir, "RUN_DIR", plain)  # before the first write into logs/ or checkpoints/
    run = Run.of(plain)  # once per rank: everything below takes it
    storage.configure(run.storage_options)  # s3:// and gs:// paths: the config's store options
    env = DistEnv.from_env(str(run.backend.name))  # a plain string, as config.yaml holds it
    if "RANK" in os.environ:  # a process of its own: titled `disttrain rank R/W RUN_DIR` in ps aux
        name_process(env.rank, env.world_size, str(run_dir.absolute()))  # (`disttrain show` finds it)
    else:  # launcher=inprocess: the launcher's own process keeps its command line
        name_process(env.rank)
    if not env.is_zero:
        stderr_into_log(RunDir(run_dir).logs, env.rank)  # C++ stacks and library noise: its log
    elif "RANK" in os.environ:  # rank 0's too; disttrain's console lines keep the original stderr
        console_apart(RunDir(run_dir).logs)
    setup_logging(RunDir(run_dir).logs, env.rank, to_console=env.is_zero)
    threads = set_threads(run, env)
    launcher = launcher_pid()
    if "RANK" in os.environ:
        die_with_parent(launcher)
    alive = rank_lock(run_dir)  # while this rank lives (even past its launcher), no new ranks here
    try:
        init_process_group(env, run.backend.timeout, cpu_collectives=specs.cpu_collectives(run))
        mark("process_group")
        if env.is_zero:
            rank_up(console.file)  # the launch phase is over: the console is rank 0's from here
            log.info(
                "rank 0 of %d | backend %s | strategy %s | %d threads per rank | run dir %s",
                env.world_size,
                env.backend,
                run.strategy.name,
                threads,
                run_dir,
            )
        report_env(run_dir, env, threads)
        check_shared(run, run_dir, env)  # several nodes: all see checkpoint.dir, or fail before training
        with prints_into_log():  # user code's print: the rank's log, not stdout
            summary = train(run, env, run_dir)
    except ConfigError as exc:
        log.error("rank %d: %s", env.rank, exc)  # one paragraph, no traceback
        raise
    except KeyboardInterrupt:  # Ctrl-C while the stop flag does not hold SIGINT (start-up, the signal save)
        log.warning("rank %d: interrupted by SIGINT: exiting without a checkpoint", env.rank)
        raise
    except BaseException as exc:
        log.exception("rank %d failed", env.rank)
        if env.is_zero:
            record_orphaned(run_dir, launcher, f"the ranks stopped without a checkpoint ({exc})")
        linger_after_a_peer_died(str(exc))
        raise
    finally:
        destroy_process_group()
        teardown_logging()
        if alive is not None:
            os.close(alive)
    if summary.get("stopped_by"):  # SIGTERM/SIGINT: state saved, exit as the signal would
        if env.is_zero:
            record_orphaned(run_dir, launcher, f"the ranks stopped at step {summary['steps']} on the signal")
        raise SystemExit(128 + int(getattr(signal, summary["stopped_by"])))
    return summary


def train(run: Run, env: DistEnv, run_dir: Path) -> dict[str, Any]:
    resume_from = resume_location(run, run_dir)
    run, reshaped = keep_global_batch(run, checkpoint_meta(resume_from), specs.layout(run, env.world_size).dp)
    if reshaped and env.is_zero:  # before the loaders exist: they take the resumed run's batch shape
        log.warning("resuming at another world size: %s", reshaped)
    strategy, parts = build_parts(run, env, run_dir / adapters.BASE_RECORD)
    model, optimizer = parts.model, parts.optimizer
    metrics = make_metrics(run_dir, env.is_zero, run)
    try:
        engine = build_engine(run, env, run_dir, strategy, parts, metrics)
        path = engine.resume(resume_from)
        if path is None and resume_from is not None:
            if resume_from != checkpoint_dir(run, run_dir):  # an explicit resume=PATH: never start over
                raise RuntimeError(f"resume={resume_from}: no loadable checkpoint there")
            log.warning("no loadable checkpoint under %s: starting from step 0", resume_from)
        start_step = engine.state.step
        mark("built")
        frozen = frozen_base(run, env, strategy.unwrap(model))
        summary = engine.fit()
        if path is not None:
            summary["resumed_from"] = str(path)
        summary.update(frozen())  # a collective: every rank
    finally:
        metrics.close()
    launched, enter = float(os.environ.get("DISTTRAIN_LAUNCH_TIME", "0") or 0), enter_time()
    if launched and summary.get("first_step_at"):
        summary["time_to_first_step_s"] = round(summary["first_step_at"] - launched, 3)
    if enter and summary.get("first_step_at"):  # the wait the user had, from Enter
        summary["enter_to_first_step_s"] = round(summary["first_step_at"] - enter, 3)
    summary.update(strategy.summary_stats(model, optimizer))  # a collective: every rank
    if env.is_zero:  # a finished run resumed trains nothing: its summary.json stays
        record_summary(
            summary, RunDir(run_dir).summary, trained=path is None or summary["steps"] > start_step
        )
    return summary


def frozen_base(run: Run, env: DistEnv, model: torch.nn.Module) -> Callable[[], dict[str, Any]]:
    """peft=lora: this rank's frozen shards hashed now; the returned call (after training, on every
    rank) hashes them again and gives summary.json's `peft` numbers, `base_unchanged` true only when
    no rank's frozen base changed by a bit. Without peft: nothing."""
    if not adapters.enabled(run.peft):
        return dict
    import torch.distributed as dist

    before = adapters.fingerprint(adapters.frozen(model))

    def after() -> dict[str, Any]:
        changed = torch.tensor(
            [int(adapters.fingerprint(adapters.frozen(model)) != before)], device=env.device
        )
        if dist.is_initialized() and env.world_size > 1:
            dist.all_reduce(changed, op=dist.ReduceOp.MAX)
        trainable, total = adapters.counts(model)
        return {
            "peft": {
                "trainable_params": trainable,
                "total_params": total,
                "base_unchanged": not changed.item(),
            }
        }

    return after


def build_parts(
    run: Run, env: DistEnv, base: Path | None = None, record: bool = True
) -> tuple[Strategy, Parts]:
    """nanoGPT order: seed, data, model, strategy, optimizer, loaders, schedule, task. `base`:
    where peft=lora's base is recorded: compared when there, else written (`record`: training)."""
    trainer = run.trainer
    seed_everything(run.seed)  # identical model init on every rank
    train_set, val_set = build_datasets(run.data)
    lora = adapters.enabled(run.peft)
    if lora:  # the base is built as `export` rebuilds it: right after the seed
        seed_everything(run.seed)
    # init.path filling a sharded model: built on meta where safe (init_from.build says why not);
    # peft=lora's adapters go onto the whole, loaded base before sharding: never on meta
    meta_setup = specs.get(run.strategy.name).meta_setup and not lora
    model, on_meta = init_from.build(run.init, lambda: build_model(run.model), meta_setup)
    if lora:
        model = adapt(run, env, model, base, record)
    to_master_dtype(
        model, DTYPES[run.amp.master_dtype], env.is_zero
    )  # before sharding: the optimizer's dtype
    strategy = build_strategy(run.strategy, env, run.amp)
    strategy.trainable_only = lora  # checkpoints hold the adapters, not the frozen base
    seed_everything(run.seed + strategy.rng_rank())  # per-rank randomness from here on (dropout, ...)
    model = strategy.precision.convert(model, precompute=not trainer.ema.decay)  # amp=fp8, before sharding
    prepare_blocks(  # activation checkpointing and regional compile: per block, before wrapping
        model, trainer.activation_checkpointing, trainer.compile, trainer.compile_backend, env.is_zero
    )
    model = strategy.setup_module(model)
    if on_meta:
        model.to_empty(device=env.device)  # this rank's shards only; apply fills every one of them
    if not lora:  # (peft=lora loaded them into the whole model, under the adapters)
        init_from.apply(run.init, strategy.unwrap(model), env.is_zero, strategy.model_key)  # init.path
    if trainer.compile == "true":
        name = type(strategy.unwrap(model)).__name__
        log.info("trainer.compile: torch.compile of %s (%s)", name, trainer.compile_backend)
        model.compile(backend=trainer.compile_backend)  # in place: parameter names (and checkpoints) stay
    dp_rank_size = strategy.data_parallel_rank_size()  # pipeline/tp ranks share data: not env.rank/world
    optimizer = strategy.setup_optimizer(build_optimizer(run.optim, model, dp_rank_size[1]))
    train_loader, val_loader = make_loaders(run, env, train_set, val_set, dp_rank_size)
    batches = loader_batches(train_loader)  # None: a stream, which trains for trainer.max_steps
    scheduler = build_scheduler(run.sched, optimizer, total_steps(trainer, batches or 0))
    task = build_task(run.task).setup(env.device)
    return strategy, Parts(model, optimizer, scheduler, task, train_loader, val_loader)


def adapt(run: Run, env: DistEnv, model: torch.nn.Module, base: Path | None, record: bool) -> torch.nn.Module:
    """peft=lora: init.path's weights into the whole model, the base recorded (or compared with
    the record) by rank 0, then the LoRA adapters (disttrain.models.adapters)."""
    import torch.distributed as dist

    init_from.apply(run.init, model, env.is_zero)
    problem = [""]
    if env.is_zero and base is not None:
        problem = [adapters.keep_base(base, adapters.base_record(run, model), write=record)]
    if dist.is_initialized() and env.world_size > 1:
        dist.broadcast_object_list(problem, src=0)
    if problem[0]:
        raise ConfigError("peft", "lora", "adapters over the base they were trained on", problem[0])
    return adapters.apply(run.peft, model, env.is_zero)


def build_engine(
    run: Run, env: DistEnv, run_dir: Path, strategy: Strategy, parts: Parts, metrics: NullMetrics
) -> Engine:
    """The engine and what it is handed: the train state, the checkpoint manager given its state
    objects explicitly, the step guards and the profiler."""
    trainer = run.trainer
    state = TrainState()
    ema = build_ema(trainer.ema, strategy.unwrap(parts.model))  # shaped like the (sharded) parameters
    states: dict[str, Any] = {
        "model": ModelState(strategy, parts.model, parts.optimizer, ema),
        "scheduler": parts.scheduler,
        "train": state,
    }
    if strategy.precision.scaling:
        states["scaler"] = strategy.precision.scaler
    if trainer.ema.decay:
        states["ema"] = ema
    lay = strategy.layout
    info = run_info(run, strategy.name, lay.world, lay.dp, global_batch(trainer, lay.dp))
    info.update(data_info(parts), layout=lay.degrees())  # the checkpoint's geometry
    ckpt = Checkpointer(
        run.checkpoint,
        checkpoint_dir(run, run_dir),  # checkpoint.dir, else <run dir>/checkpoints
        env,
        states,
        run_info=info,
        barrier=strategy.barrier,
        extra_meta=lambda: {"trackers": metrics.tracker_state()},  # rank 0: tracker runs to continue
        rank_states=stream_position(parts),
    )
    guards = Guards(
        trainer.detect_anomaly, run.debug, env, strategy.precision, strategy, parts.model, ckpt.dir
    )
    profiler = make_profiler(run.profile, run.profiler, run_dir, env.rank)
    return Engine(
        trainer,
        env,
        strategy,
        parts,
        state=state,
        ckpt=ckpt,
        metrics=metrics,
        guards=guards,
        profiler=profiler,
        timeout_s=float(run.backend.timeout),
        ema=ema,
    )


def data_info(parts: Parts) -> dict[str, Any]:
    """What meta.json records of the training data for a resume to compare: whether it is a stream
    (its position is not an index), and the sizes of the files a data set reads (data=tokens)."""
    info: dict[str, Any] = {"data_stream": loader_batches(parts.train_loader) is None}
    files = getattr(getattr(parts.train_loader, "dataset", None), "files", None)
    if callable(files):
        info["data_files"] = files()
    return info


def stream_position(parts: Parts) -> dict[str, Any]:
    """{"loader": what saves a stream's position} (per rank, per worker), or {}: a map-style
    training set resumes from TrainState's position in the sampler's permutation instead."""
    if loader_batches(parts.train_loader) is not None:
        return {}
    saver = loader_state(parts.train_loader)
    return {} if saver is None else {LOADER: saver}


def launcher_pid() -> int:
    """The process that started this rank (the launcher sets it: by the time a slow rank asks for
    its parent, a dead launcher's place may already be taken by init)."""
    return int(os.environ.get("DISTTRAIN_LAUNCHER_PID") or os.getppid())


def die_with_parent(launcher: int) -> None:
    """Linux: SIGTERM this rank when its launcher dies (even by SIGKILL): no orphaned ranks.

    The kernel sends that signal once per thread that inherited the setting, so a rank may get
    several at once; StopFlag counts them as one while the launcher is gone.
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        return
    # The parent is the launcher, or its fork server (which exits with the launcher).
    parent = int(os.environ.get("DISTTRAIN_RANK_PARENT") or launcher)
    if os.getppid() != parent or not launcher_alive(launcher):  # it died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def set_threads(run: Run, env: DistEnv) -> int:
    """cores / local ranks intra-op threads: mp.spawn's default of all cores per rank oversubscribes."""
    threads = run.threads_per_rank or max(1, len(os.sched_getaffinity(0)) // env.local_world_size)
    torch.set_num_threads(threads)
    return threads


if __name__ == "__main__":
    from disttrain.dist import exit_rank, rank_main

    exit_rank(rank_main(run, "disttrain.worker"))
