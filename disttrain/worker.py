"""Per-rank entry: the only place that owns the process group.

Every launcher (torchrun, spawn, in-process, already-launched) ends here with a run dir whose
config.yaml was resolved once by the parent; a rank never re-composes or re-resolves the config.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from disttrain import checkpoint
from disttrain.config.errors import ConfigError
from disttrain.data import build_datasets
from disttrain.dist import DistEnv, destroy_process_group, hostname, init_process_group
from disttrain.engine.loop import Engine, total_steps
from disttrain.engine.optim import build_optimizer, build_scheduler
from disttrain.engine.resume import ResumableSampler
from disttrain.models import build_model
from disttrain.observe.log import get_logger, setup_logging, teardown_logging
from disttrain.observe.metrics import NullMetrics, make_metrics, tracker_resume
from disttrain.observe.summary import print_summary
from disttrain.rundir import read_config, write_json
from disttrain.shared_dir import check_shared, checkpoint_dir
from disttrain.strategies import build_strategy
from disttrain.tasks import build_task
from disttrain.timing import mark, mark_process_start
from disttrain.tools.envreport import collect_env

log = get_logger()


def run(run_dir: str | Path) -> dict[str, Any] | None:
    """Train as the rank described by the environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*)."""
    mark_process_start("rank_start")
    mark("rank_imported")
    run_dir = Path(run_dir)
    cfg = read_config(run_dir)
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())  # the user's own modules, as in the parent; never ahead of torch
    env = DistEnv.from_env(cfg["backend"]["name"])
    setup_logging(run_dir / "logs", env.rank, to_console=env.is_zero)
    threads = set_threads(cfg, env)
    launcher = launcher_pid()
    if "RANK" in os.environ:
        die_with_parent(launcher)
    try:
        init_process_group(env, cfg["backend"]["timeout"])
        mark("process_group")
        if env.is_zero:
            log.info(
                "rank 0 of %d | backend %s | strategy %s | %d threads per rank | run dir %s",
                env.world_size,
                env.backend,
                cfg["strategy"]["name"],
                threads,
                run_dir,
            )
        report_env(run_dir, env, threads)
        check_shared(cfg, run_dir, env)  # several nodes: all see checkpoint.dir, or fail before training
        summary = train(cfg, env, run_dir)
    except ConfigError as exc:
        log.error("rank %d: %s", env.rank, exc)  # one paragraph, no traceback
        raise
    except BaseException as exc:
        log.exception("rank %d failed", env.rank)
        if env.is_zero:
            record_orphaned(run_dir, launcher, f"the ranks stopped without a checkpoint ({exc})")
        raise
    finally:
        destroy_process_group()
        teardown_logging()
    if summary.get("stopped_by"):  # SIGTERM/SIGINT: state saved, exit as the signal would
        if env.is_zero:
            record_orphaned(run_dir, launcher, f"the ranks stopped at step {summary['steps']} on the signal")
        raise SystemExit(128 + int(getattr(signal, summary["stopped_by"])))
    return summary


def train(cfg: dict[str, Any], env: DistEnv, run_dir: Path) -> dict[str, Any]:
    seed_everything(cfg["seed"])  # identical model init on every rank
    train_set, val_set = build_datasets(cfg["data"])
    model = build_model(cfg["model"])
    seed_everything(cfg["seed"] + env.rank)  # per-rank randomness from here on (dropout, ...)
    strategy = build_strategy(cfg["strategy"], env)
    strategy.precision = strategy.make_precision(cfg.get("amp") or {})
    prepare_model(model, cfg["trainer"])
    model = strategy.setup_module(model)
    if cfg["trainer"].get("compile"):
        log.info("trainer.compile: torch.compile of %s (inductor)", type(strategy.unwrap(model)).__name__)
        model.compile()  # in place: parameter names (and so checkpoints) stay the same
    dp_rank_size = strategy.data_parallel_rank_size()  # pipeline/tp ranks share data: not env.rank/world
    optimizer = strategy.setup_optimizer(build_optimizer(cfg["optim"], model, dp_rank_size[1]))
    train_loader, val_loader = make_loaders(cfg, env, train_set, val_set, dp_rank_size)
    scheduler = build_scheduler(cfg["sched"], optimizer, total_steps(cfg["trainer"], len(train_loader)))
    resume_from = resume_location(cfg, run_dir)
    metrics = None
    try:
        engine = Engine(
            cfg["trainer"],
            env,
            strategy,
            model,
            optimizer,
            scheduler,
            build_task(cfg["task"]).setup(env.device),
            train_loader,
            val_loader,
            NullMetrics(),
            run_dir,
            checkpoint_cfg=cfg.get("checkpoint") or {},
            run_cfg=cfg,
            timeout_s=float(cfg["backend"]["timeout"]),
        )
        path = engine.ckpt.resume(resume_from) if resume_from else None
        meta = checkpoint.read_meta(path) if path is not None and env.is_zero else None
        if meta is not None:
            truncate_metrics(run_dir / "metrics.jsonl", engine.state.step)
        trackers, from_step = tracker_resume(run_dir, meta) if env.is_zero else (None, 0)
        engine.metrics = metrics = make_metrics(run_dir, env.is_zero, cfg, trackers, from_step)
        if path is None and resume_from is not None:
            if resume_from != checkpoint_dir(cfg, run_dir):  # an explicit resume=PATH: never start over
                raise RuntimeError(f"resume={resume_from}: no loadable checkpoint there")
            log.warning("no loadable checkpoint under %s: starting from step 0", resume_from)
        start_step = engine.state.step
        mark("built")
        summary = engine.fit()
        if path is not None:
            summary["resumed_from"] = str(path)
    finally:
        if metrics is not None:
            metrics.close()
    launched = float(os.environ.get("DISTTRAIN_LAUNCH_TIME", "0") or 0)
    if launched and summary.get("first_step_at"):
        summary["time_to_first_step_s"] = round(summary["first_step_at"] - launched, 3)
    summary.update(strategy.summary_stats(model, optimizer))  # a collective: every rank
    trained = path is None or summary["steps"] > start_step  # a finished run resumed trains nothing
    if env.is_zero and not summary.get("stopped_by") and trained:
        write_json(run_dir / "summary.json", summary)
        print_summary(summary)
    elif env.is_zero and not trained:
        log.warning("no step ran (the run had already finished): summary.json left as it was")
    return summary


def prepare_model(model: Any, trainer: dict[str, Any]) -> None:
    """trainer.activation_checkpointing: the built-in models recompute each block in backward."""
    if not trainer.get("activation_checkpointing"):
        return
    setter = getattr(model, "set_activation_checkpointing", None)
    if setter is None:
        log.warning(
            "trainer.activation_checkpointing=true is ignored: %s has no set_activation_checkpointing()",
            type(model).__name__,
        )
        return
    setter(True)


class ShardSampler(Sampler[int]):
    """Every `world`-th index from `rank`: each sample exactly once across ranks, no padding.

    Shards differ by at most one sample, so ranks may differ by one batch; `longest` (the largest
    shard) lets validation run the same number of forwards everywhere, which strategies whose
    forward is a collective (fsdp all-gathers, tp, pipeline) need.
    """

    def __init__(self, length: int, rank: int, world: int) -> None:
        self.indices = range(rank, length, world)
        self.longest = -(-length // world)

    def __iter__(self) -> Any:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def make_loaders(
    cfg: dict[str, Any],
    env: DistEnv,
    train_set: Dataset,
    val_set: Dataset | None,
    dp_rank_size: tuple[int, int] | None = None,
) -> tuple[DataLoader, DataLoader | None]:
    """The same global permutation for any world size: rank r takes every world-th sample of it.

    `dp_rank_size` is the strategy's (rank, size) among data-parallel replicas (default: the world).
    """
    dp_rank, dp_size = dp_rank_size or (env.rank, env.world_size)
    data, batch = cfg["data"], cfg["trainer"]["batch_size"]
    common: dict[str, Any] = {"num_workers": data["num_workers"], "pin_memory": data["pin_memory"]}
    if data["num_workers"] > 0:
        common["persistent_workers"] = bool(data.get("persistent_workers", True))
        if data.get("prefetch_factor") is not None:
            common["prefetch_factor"] = int(data["prefetch_factor"])
    sampler: DistributedSampler = ResumableSampler(
        train_set,
        num_replicas=dp_size,
        rank=dp_rank,
        shuffle=data["shuffle"],
        seed=cfg["seed"],
        drop_last=True,
    )
    train = DataLoader(train_set, batch_size=batch, sampler=sampler, drop_last=data["drop_last"], **common)
    val = None
    if val_set is not None:
        shard = ShardSampler(len(val_set), dp_rank, dp_size)  # type: ignore[arg-type]
        val = DataLoader(val_set, batch_size=batch, sampler=shard, **common)
    return train, val


def resume_location(cfg: dict[str, Any], run_dir: Path) -> Path | None:
    """Where to continue from: a restart or resume=auto takes the run dir's own checkpoints first."""
    own = checkpoint_dir(cfg, run_dir)
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
    resume = cfg.get("resume", "auto")
    if checkpoint.committed(own) and (resume == "auto" or restarted):
        return own
    if resume in (None, "auto", "never"):
        return None
    return Path(str(resume))


def truncate_metrics(path: Path, step: int) -> None:
    """Drop records logged after `step` (the resumed run logs those steps again), and lines a crash
    cut mid-write (they would break every later reader; tools.runs skips them the same way)."""
    if not path.is_file():
        return
    from disttrain.tools.runs import read_metrics

    lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    kept = [r for r in read_metrics(path.parent) if isinstance(r, dict) and r.get("step", 0) <= step]
    if len(kept) != len(lines):
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
        os.replace(tmp, path)


def record_orphaned(run_dir: Path, launcher: int, what: str) -> None:
    """The launcher died (SIGKILL: it could not record it): status.json must not stay `running`."""
    from disttrain.rundir import STATUS

    if os.getppid() == launcher:
        return  # the launcher is alive and writes the status itself
    try:
        status = json.loads((run_dir / STATUS).read_text())
    except (OSError, ValueError):
        return
    if status.get("status") != "running" or status.get("pid") != launcher:
        return
    status.update(
        status="interrupted", error=f"the launcher (pid {launcher}) died; {what}", ended=time.time()
    )
    write_json(run_dir / STATUS, status)
    log.warning("the launcher (pid %d) is gone: %s says interrupted", launcher, run_dir / STATUS)


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
    if os.getppid() != launcher:  # the launcher died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def set_threads(cfg: dict[str, Any], env: DistEnv) -> int:
    """cores / local ranks intra-op threads: mp.spawn's default of all cores per rank oversubscribes."""
    threads = cfg.get("threads_per_rank") or max(1, len(os.sched_getaffinity(0)) // env.local_world_size)
    torch.set_num_threads(threads)
    return threads


def report_env(run_dir: Path, env: DistEnv, threads: int) -> None:
    hosts: list[Any] = [hostname()]
    if dist.is_initialized() and env.world_size > 1:
        hosts = [None] * env.world_size
        dist.all_gather_object(hosts, hostname())
    if env.is_zero:
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        if restart and (run_dir / "env.json").is_file():  # a restart: the machine was reported; be quick
            report = json.loads((run_dir / "env.json").read_text())
            report.setdefault("restarts", []).append({"attempt": restart, "time": time.time()})
            write_json(run_dir / "env.json", report)
            return
        report = collect_env()
        report.update(
            backend=env.backend,
            world_size=env.world_size,
            local_world_size=env.local_world_size,
            threads_per_rank=threads,
            hosts=hosts,
            device=str(env.device),
            started=time.time(),
        )
        write_json(run_dir / "env.json", report)


if __name__ == "__main__":
    from disttrain.dist import exit_rank, rank_main

    exit_rank(rank_main(run, "disttrain.worker"))
