"""`Layout`: how a run's ranks split the work, built once from the run by its strategy's spec.

torchtitan's `ParallelDims`: data-parallel replicas (`dp_replicate`) and shards (`dp_shard`),
context (`cp`: the sequence split), tensor (`tp`) and pipeline (`pp`) degrees, whose product is the
world; `ep` (experts) borrows ranks from dp_shard x cp, as torchtitan's does. `zero` is the ZeRO
stage the sharded ranks split the training state at (1: optimizer state, 2: + gradients, 3: +
parameters). The strategies build their meshes from it, `disttrain plan` and `plan --simulate`
count its degrees, and checkpoints record it. Torch-free: `mesh` imports torch when a rank calls it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

DIMS = ("dp", "cp", "tp", "pp")  # the mesh dimensions in rank order (row-major: dp outermost)


@dataclass(frozen=True)
class Layout:
    world: int
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    zero: int = 0

    def __post_init__(self) -> None:
        split = (self.dp_replicate, self.dp_shard, self.cp, self.tp, self.pp)
        if min(*split, self.ep) < 1 or math.prod(split) != self.world:
            raise ValueError(f"{self}: dp_replicate x dp_shard x cp x tp x pp must be world {self.world}")
        if (self.dp_shard * self.cp) % self.ep:
            raise ValueError(f"{self}: ep {self.ep} must divide dp_shard x cp {self.dp_shard * self.cp}")

    @property
    def dp(self) -> int:
        """Data-parallel replicas: ranks that read different batches."""
        return self.dp_replicate * self.dp_shard

    @property
    def shard(self) -> int:
        """Ranks the training state is sharded over at the ZeRO stage (1: none): the data-parallel
        shards and, as torchtitan's FSDP does, the context-parallel ranks."""
        return self.dp_shard * self.cp if self.zero else 1

    def dims(self) -> dict[str, int]:
        """The mesh dimensions in rank order (row-major: dp outermost, pp innermost): dp, tp, pp
        always, cp where the layout splits the sequence."""
        sizes = self.sizes()
        return {d: sizes[d] for d in DIMS if d != "cp" or self.cp > 1}

    def degrees(self) -> dict[str, int]:
        """What `plan` and `plan --simulate` report: the dims, the ZeRO stage, the shard size, and
        ep where the layout has experts."""
        return {
            **self.dims(),
            "zero": self.zero,
            "shard": self.shard,
            **({"ep": self.ep} if self.ep > 1 else {}),
        }

    def sizes(self) -> dict[str, int]:
        """Each mesh dimension a strategy may name: dp (replicate x shard), replicate, shard (what FSDP
        shards over: the data-parallel shards and the context-parallel ranks, torchtitan's dp_shard_cp),
        cp, tp, pp."""
        return {
            "dp": self.dp,
            "replicate": self.dp_replicate,
            "shard": self.dp_shard * self.cp,
            "cp": self.cp,
            "tp": self.tp,
            "pp": self.pp,
        }

    def mesh(self, device_type: str, names: tuple[str, ...]) -> Any:
        """The DeviceMesh over the named dimensions (`sizes()`), outermost first; they span the world."""
        from torch.distributed.device_mesh import init_device_mesh

        shape = tuple(self.sizes()[n] for n in names)
        if math.prod(shape) != self.world:
            raise ValueError(f"mesh {dict(zip(names, shape, strict=True))} does not span world {self.world}")
        return init_device_mesh(device_type, shape, mesh_dim_names=names)


def replicas(s: Any, world: int) -> Layout:
    """Every rank a whole replica reading its own batches (ddp, single, dp, localsgd)."""
    return Layout(world, dp_replicate=world)
