"""Iterable (streaming) data sets: who reads which element, and the loader that can say where it is.

A `torch.utils.data.IterableDataset` has no index a sampler could split, so either the data set
gives each rank and DataLoader worker its own part (it reads `torch.distributed.get_rank()` and
`torch.utils.data.get_worker_info()`: `data.shard=none`, the default), or disttrain wraps it
(`data.shard=auto`): with D data-parallel replicas and W workers per rank (W = 1 without workers),
the (replica r, worker w) pair has slot `r * W + w` and reads element i of the stream exactly when
`i % (D * W) == slot`. Every pair walks the whole stream and keeps its share: right for a cheap
stream (a memory-mapped file), wasteful for an expensive one, which should shard itself by file.

The training loader of a stream is torchdata's `StatefulDataLoader` (imported only here, only for
streams): its `state_dict` holds this rank's position, per worker, which the checkpoint keeps per
rank, so a resumed stream continues with the batch after the last one trained on.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info

LOADER = "loader"  # the name of a stream's position among a checkpoint's per-rank states


def is_stream(dataset: Any) -> bool:
    """An IterableDataset: no index, no sampler; read in the order it yields."""
    return isinstance(dataset, IterableDataset)


def slot(dp_rank: int, dp_size: int, worker: int, workers: int) -> tuple[int, int]:
    """(this reader's slot, readers in all): element i goes to the reader with i % readers == slot."""
    workers = max(1, workers)
    return dp_rank * workers + worker, dp_size * workers


class ShardedStream(IterableDataset):
    """`data.shard=auto`: this rank's (and, inside a DataLoader worker, this worker's) share of a
    stream: element i when i % readers == slot (see `slot`). Picklable as the wrapped data set is."""

    def __init__(self, dataset: IterableDataset, dp_rank: int, dp_size: int) -> None:
        self.dataset, self.dp_rank, self.dp_size = dataset, dp_rank, dp_size

    def reader(self) -> tuple[int, int]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return slot(self.dp_rank, self.dp_size, worker, workers)

    def __iter__(self) -> Iterator[Any]:
        me, readers = self.reader()
        return itertools.islice(iter(self.dataset), me, None, readers)


class StatefulShardedStream(ShardedStream):
    """ShardedStream over a data set with its own state_dict: that state is the position (the
    wrapped stream restarts where it stopped, and its elements keep their indices from there)."""

    def __init__(self, dataset: IterableDataset, dp_rank: int, dp_size: int) -> None:
        super().__init__(dataset, dp_rank, dp_size)
        self.offset = 0  # elements of the wrapped stream consumed before its restored position

    def state_dict(self) -> dict[str, Any]:
        return {"dataset": self.dataset.state_dict(), "offset": self.offset}  # type: ignore[attr-defined]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state["dataset"])  # type: ignore[attr-defined]
        self.offset = int(state["offset"])

    def __iter__(self) -> Iterator[Any]:
        me, readers = self.reader()
        for i, item in enumerate(iter(self.dataset), start=self.offset):
            if i % readers == me:
                self.offset = i + 1
                yield item
        self.offset = 0  # the stream ended: the next pass starts from its beginning


def shard(dataset: Any, mode: str, dp_rank: int, dp_size: int) -> Any:
    """The data set one rank reads: a stream wrapped for `data.shard=auto`, anything else as is."""
    if mode != "auto" or not is_stream(dataset):
        return dataset
    cls = StatefulShardedStream if has_state(dataset) else ShardedStream
    return cls(dataset, dp_rank, dp_size)


def has_state(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def first_samples(dataset: Any, n: int) -> list[Any]:
    """The first `n` samples (fewer when it has fewer), by index or by iteration."""
    if is_stream(dataset):
        return list(itertools.islice(iter(dataset), n))
    return [dataset[i] for i in range(min(len(dataset), n))]


def stateful_loader_class() -> type | None:
    """torchdata's StatefulDataLoader (the `disttrain[stream]` extra), or None when not installed."""
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        return None
    return StatefulDataLoader


def loader_state(loader: Any) -> Any | None:
    """What saves this loader's position: a StatefulDataLoader itself; a stream with its own state
    read in the training process (no workers: its position is the loader's); else None."""
    if type(loader).__name__ == "StatefulDataLoader" and has_state(loader):
        return loader
    if getattr(loader, "num_workers", 0) == 0 and is_stream(loader.dataset) and has_state(loader.dataset):
        return loader.dataset
    return None
