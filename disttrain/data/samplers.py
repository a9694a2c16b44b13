"""How ranks split the data: the training permutation (resumable mid-epoch) and validation shards."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DistributedSampler, Sampler


class ResumableSampler(DistributedSampler):
    """DistributedSampler that can start an epoch at per-rank index `start`.

    The skipped part of the epoch's permutation is cut off by index (no batch is loaded), so a
    resumed run sees exactly the samples the interrupted one had not yet seen.
    """

    start: int = 0

    def set_start(self, start: int) -> None:
        self.start = max(0, start)

    def __iter__(self) -> Iterator[int]:
        if not self.shuffle and self.drop_last:
            # The same indices as DistributedSampler's, as a range: a data set of a billion windows
            # (data=tokens) costs no list of a billion ints per rank.
            return iter(range(self.rank, self.total_size, self.num_replicas)[self.start :])
        indices = list(super().__iter__())
        return iter(indices[self.start :])

    def __len__(self) -> int:
        return max(0, super().__len__() - self.start)

    def global_order(self, epoch: int) -> list[int]:
        """Epoch `epoch`'s samples in the order the ranks read them together: rank r reads places
        r, r + world, ... of it, so after k samples per rank the ranks have read its first
        k x world. DistributedSampler's permutation, before it is dealt out (and cut: drop_last)."""
        n = len(self.dataset)  # type: ignore[arg-type]
        if not self.shuffle:
            return list(range(n))[: self.total_size]
        g = torch.Generator()
        g.manual_seed(self.seed + epoch)
        return torch.randperm(n, generator=g).tolist()[: self.total_size]


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
