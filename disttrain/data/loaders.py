"""The training and validation DataLoaders of one rank: which samples it reads, in which order."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from disttrain.data.samplers import ResumableSampler, ShardSampler
from disttrain.dist import DistEnv


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
    for dataset in (train_set, val_set):  # a stream that splits itself by rank (data=hf streaming)
        split_by_node = getattr(dataset, "split_by_node", None)
        if split_by_node is not None:
            split_by_node(dp_rank, dp_size)
    data, batch = cfg["data"], cfg["trainer"]["batch_size"]
    common: dict[str, Any] = {"num_workers": data["num_workers"], "pin_memory": data["pin_memory"]}
    if data["num_workers"] > 0:
        common["persistent_workers"] = bool(data["persistent_workers"])
        if data["prefetch_factor"] is not None:
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
        # Its own generator: a DataLoader iterator draws its base seed from `generator`, else from
        # torch's global RNG, which training's dropout draws from too; a validation (say the one
        # ending a run that is later extended) would shift training's draws and break exact resume.
        generator = torch.Generator().manual_seed(cfg["seed"])
        val = DataLoader(val_set, batch_size=batch, sampler=shard, generator=generator, **common)
    return train, val
