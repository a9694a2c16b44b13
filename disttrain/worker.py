"""Per-rank entry: the only place that owns the process group.

Every launcher (torchrun, spawn, in-process, already-launched) ends here with a run dir whose
config.yaml was resolved once by the parent; a rank never re-composes or re-resolves the config.
"""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from disttrain.data import build_datasets
from disttrain.dist import DistEnv, destroy_process_group, hostname, init_process_group
from disttrain.engine.loop import Engine, total_steps
from disttrain.engine.optim import build_optimizer, build_scheduler
from disttrain.engine.tasks import build_task
from disttrain.models import build_model
from disttrain.observe.log import get_logger, setup_logging, teardown_logging
from disttrain.observe.metrics import make_metrics
from disttrain.rundir import read_config, write_json
from disttrain.strategies import build_strategy
from disttrain.tools.envreport import collect_env

log = get_logger()


def run(run_dir: str | Path) -> dict[str, Any] | None:
    """Train as the rank described by the environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*)."""
    run_dir = Path(run_dir)
    cfg = read_config(run_dir)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # the user's own modules, as in the parent
    env = DistEnv.from_env(cfg["backend"]["name"])
    setup_logging(run_dir / "logs", env.rank, to_console=env.is_zero)
    threads = set_threads(cfg, env)
    try:
        init_process_group(env, cfg["backend"]["timeout"])
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
        summary = train(cfg, env, run_dir)
        return summary
    except BaseException:
        log.exception("rank %d failed", env.rank)
        raise
    finally:
        destroy_process_group()
        teardown_logging()


def train(cfg: dict[str, Any], env: DistEnv, run_dir: Path) -> dict[str, Any]:
    seed_everything(cfg["seed"])  # identical model init on every rank
    train_set, val_set = build_datasets(cfg["data"])
    model = build_model(cfg["model"])
    seed_everything(cfg["seed"] + env.rank)  # per-rank randomness from here on (dropout, ...)
    strategy = build_strategy(cfg["strategy"], env)
    model = strategy.setup_module(model)
    optimizer = strategy.setup_optimizer(build_optimizer(cfg["optim"], model.parameters(), env.world_size))
    train_loader, val_loader = make_loaders(cfg, env, train_set, val_set)
    scheduler = build_scheduler(cfg["sched"], optimizer, total_steps(cfg["trainer"], len(train_loader)))
    metrics = make_metrics(run_dir, env.is_zero)
    try:
        engine = Engine(
            cfg["trainer"],
            env,
            strategy,
            model,
            optimizer,
            scheduler,
            build_task(cfg["data"]["task"]),
            train_loader,
            val_loader,
            metrics,
            run_dir,
        )
        summary = engine.fit()
    finally:
        metrics.close()
    launched = float(os.environ.get("DISTTRAIN_LAUNCH_TIME", "0") or 0)
    if launched and summary.get("first_step_at"):
        summary["time_to_first_step_s"] = round(summary["first_step_at"] - launched, 3)
    summary["state_bytes_per_rank"] = strategy.local_state_bytes(model, optimizer)
    if env.is_zero:
        write_json(run_dir / "summary.json", summary)
    return summary


class ShardSampler(Sampler[int]):
    """Every `world`-th index from `rank`: each sample exactly once across ranks, no padding."""

    def __init__(self, length: int, rank: int, world: int) -> None:
        self.indices = range(rank, length, world)

    def __iter__(self) -> Any:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def make_loaders(
    cfg: dict[str, Any], env: DistEnv, train_set: Dataset, val_set: Dataset | None
) -> tuple[DataLoader, DataLoader | None]:
    """The same global permutation for any world size: rank r takes every world-th sample of it."""
    data, batch = cfg["data"], cfg["trainer"]["batch_size"]
    common: dict[str, Any] = {"num_workers": data["num_workers"], "pin_memory": data["pin_memory"]}
    if data["num_workers"] > 0:
        common["persistent_workers"] = True
    sampler: DistributedSampler = DistributedSampler(
        train_set,
        num_replicas=env.world_size,
        rank=env.rank,
        shuffle=data["shuffle"],
        seed=cfg["seed"],
        drop_last=True,
    )
    train = DataLoader(train_set, batch_size=batch, sampler=sampler, drop_last=data["drop_last"], **common)
    val = None
    if val_set is not None:
        shard = ShardSampler(len(val_set), env.rank, env.world_size)  # type: ignore[arg-type]
        val = DataLoader(val_set, batch_size=batch, sampler=shard, **common)
    return train, val


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


def _main() -> int:
    from torch.distributed.elastic.multiprocessing.errors import record

    if len(sys.argv) != 2:
        sys.stderr.write("usage: python -m disttrain.worker RUN_DIR\n")
        return 2
    record(run)(sys.argv[1])
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
