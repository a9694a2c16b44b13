"""Per-rank randomness after the model is built (worker.build_parts): one dropout mask per
tensor-parallel group. TP ranks apply dropout to the same replicated activations, so a mask per
rank makes the replicated parameters drift apart (issue 27, the TP dropout finding); data-parallel
replicas keep their own streams. In-process on torch's fake process group, one rank at a time."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from disttrain import worker
from disttrain.config import compose, resolve
from disttrain.config.run import Run
from disttrain.dist import DistEnv
from disttrain.strategies import build_strategy

TINY = ("model=gpt", "model.dim=16", "model.n_layers=1", "model.n_heads=2", "model.dropout=0.1",
        "data.block_size=16", "threads_per_rank=1")  # fmt: skip


def _stream_after_build(strategy: str, world: int, rank: int, *extra: str) -> torch.Tensor:
    """The first numbers rank `rank` draws once build_parts is done (what its dropout would use)."""
    overrides = [*TINY, f"strategy={strategy}", f"nproc_per_node={world}", *extra]
    cfg = resolve(compose(overrides), overrides)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        worker.build_parts(Run.of(cfg), DistEnv(rank, rank, world, world, "gloo", torch.device("cpu")))
        return torch.rand(8)
    finally:
        dist.destroy_process_group()


def test_tp_ranks_draw_one_stream_and_data_parallel_ranks_their_own() -> None:
    tp = [_stream_after_build("tp", 2, r) for r in (0, 1)]
    assert torch.equal(tp[0], tp[1]), "the two ranks of a tp group must draw the same dropout mask"
    ddp = _stream_after_build("ddp", 2, 1)
    assert not torch.equal(ddp, tp[0]), "data-parallel replicas draw their own masks"


@pytest.mark.parametrize(
    ("name", "world", "extra", "expected"),
    [
        ("tp", 4, {}, [0, 0, 0, 0]),
        (
            "fsdp+tp",
            4,
            {"tp_degree": 2, "param_dtype": "float32"},
            [0, 0, 1, 1],
        ),  # mesh (dp=2, tp=2): tp ranks are neighbours
        ("fsdp+tp", 8, {"tp_degree": 4, "param_dtype": "float32"}, [0, 0, 0, 0, 1, 1, 1, 1]),
        ("ddp", 4, {}, [0, 1, 2, 3]),
        ("pipeline", 4, {}, [0, 1, 2, 3]),  # stages hold different layers: streams of their own
    ],
)
def test_rng_rank_is_the_data_parallel_rank_for_tensor_parallel(
    name: str, world: int, extra: dict[str, int | str], expected: list[int]
) -> None:
    got = [
        build_strategy(
            {"name": name, **extra}, DistEnv(r, r, world, world, "gloo", torch.device("cpu"))
        ).rng_rank()
        for r in range(world)
    ]
    assert got == expected
