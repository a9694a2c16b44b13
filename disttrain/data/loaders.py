"""The training and validation DataLoaders of one rank: which samples it reads, in which order."""

from __future__ import annotations

import logging
import sys
import warnings
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from disttrain.data.samplers import ResumableSampler, ShardSampler
from disttrain.data.streams import is_stream, shard, stateful_loader_class
from disttrain.dist import DistEnv

if TYPE_CHECKING:
    from disttrain.config.run import Run

log = logging.getLogger("disttrain")


def make_loaders(
    run: Run,
    env: DistEnv,
    train_set: Dataset,
    val_set: Dataset | None,
    dp_rank_size: tuple[int, int] | None = None,
) -> tuple[DataLoader, DataLoader | None]:
    """The same global permutation for any world size: rank r takes every world-th sample of it.
    A stream (IterableDataset) is read in its own order, split by `data.shard` (data/streams.py).

    `dp_rank_size` is the strategy's (rank, size) among data-parallel replicas (default: the world).
    """
    dp_rank, dp_size = dp_rank_size or (env.rank, env.world_size)
    for dataset in (train_set, val_set):  # a stream that splits itself by rank (data=hf streaming)
        split_by_node = getattr(dataset, "split_by_node", None)
        if split_by_node is not None:
            split_by_node(dp_rank, dp_size)
    data, batch = run.data, run.trainer.batch_size
    common: dict[str, Any] = {"num_workers": data.num_workers, "pin_memory": data.pin_memory}
    if data.num_workers > 0:
        common["persistent_workers"] = bool(data.persistent_workers)
        if sys.platform.startswith("linux"):
            # A rank comes from a fork server and inherits its start method: workers started by
            # the rank's own fork server are that server's children, so torch's worker watchdog
            # (its parent changed) never sees a SIGKILLed rank die and they live on, holding the
            # launcher's output. Forked workers are the rank's children: they exit within 5 s of it.
            common["multiprocessing_context"] = "fork"
        if data.prefetch_factor is not None:
            common["prefetch_factor"] = int(data.prefetch_factor)
    if is_stream(train_set):
        train = stream_loader(run, train_set, dp_rank, dp_size, common)
    else:
        sampler: DistributedSampler = ResumableSampler(
            train_set,
            num_replicas=dp_size,
            rank=dp_rank,
            shuffle=data.shuffle,
            seed=run.seed,
            drop_last=True,
        )
        train = DataLoader(train_set, batch_size=batch, sampler=sampler, drop_last=data.drop_last, **common)
    val = None
    if val_set is not None:
        # Its own generator: a DataLoader iterator draws its base seed from `generator`, else from
        # torch's global RNG, which training's dropout draws from too; a validation (say the one
        # ending a run that is later extended) would shift training's draws and break exact resume.
        generator = torch.Generator().manual_seed(run.seed)
        if is_stream(val_set):
            val_stream = shard(val_set, data.shard, dp_rank, dp_size)
            val = DataLoader(val_stream, batch_size=batch, generator=generator, **common)
        else:
            split = ShardSampler(len(val_set), dp_rank, dp_size)  # type: ignore[arg-type]
            val = DataLoader(val_set, batch_size=batch, sampler=split, generator=generator, **common)
    return train, val


def stream_loader(run: Run, train_set: Any, dp_rank: int, dp_size: int, common: dict[str, Any]) -> DataLoader:
    """A stream's training loader: torchdata's StatefulDataLoader (its position goes into each
    checkpoint) unless `data.stateful=false` or torchdata is missing (a plain DataLoader: a resume
    starts the stream over, said by a warning then). Its own generator, seeded per replica: the
    workers' seeds never draw from (and so never shift) the global RNG that dropout uses."""
    data = run.data
    stream = shard(train_set, data.shard, dp_rank, dp_size)
    stateful = bool(data.stateful)
    generator = torch.Generator().manual_seed(run.seed + dp_rank)
    kwargs: dict[str, Any] = {
        "batch_size": run.trainer.batch_size,
        "drop_last": data.drop_last,
        "generator": generator,
    }
    cls = stateful_loader_class() if stateful else None
    if cls is None:
        if stateful:
            log.warning(
                "data.train is a stream and torchdata is not installed: its position is not checkpointed "
                "(pip install 'disttrain[stream]')"
            )
        return DataLoader(stream, **kwargs, **common)
    with warnings.catch_warnings():  # torchdata 0.11 calls torch.set_vital, deprecated since
        warnings.filterwarnings("ignore", message=".*set_vital.*deprecated")
        return cls(stream, **kwargs, **common)


def loader_batches(loader: DataLoader) -> int | None:
    """Batches per epoch on this rank; None for a stream (its length is unknown until it ends)."""
    return None if is_stream(loader.dataset) else len(loader)
