"""The fake world `plan --simulate` and `--load-at` rehearse in, and every private torch name they need.

A rank of the configured layout is set up for real (`build_strategy` + `setup_module`) on torch's
fake process group with the model on the meta device. torch offers the pieces, some of them only
under private names: the fake backend and its store (`torch.testing._internal`), DTensor's sharding
cache reset, `FakeTensorMode`, `TorchDispatchMode`, DCP's state-dict flattening, a sub-mesh's root
mesh and a DTensor's local shape and offset for any coordinate. They are imported here and only
here (tests/unit/test_layers.py), each with what it does for the rehearsal: a torch upgrade that
moves one breaks this module alone.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from disttrain.config.run import Run
    from disttrain.strategies.specs import Layout

MAX_WORLD = 1024  # the largest world `plan --simulate` rehearses


# ------------------------------------------------------------------------------------ layout
def configured_layout(run: Run, plan_result: dict[str, Any]) -> tuple[Layout, dict[str, Any]]:
    """The layout of the strategy the config runs (the spec's, built from the run) and its row:
    the layout's degrees and plan's per-rank bytes for it."""
    from disttrain.strategies import specs
    from disttrain.tools.planner import per_rank

    layout = specs.layout(run)
    m, act = plan_result["model"], plan_result["activations"]["bytes"]
    row = {"layout": run.strategy.name, **layout.degrees()}
    return layout, {**row, "bytes": per_rank(layout, m["params"], plan_result["precision"], act)}


def sample_ranks(dims: dict[str, int]) -> list[tuple[int, dict[str, int]]]:
    """(rank, mesh coordinates) for the sampled ranks of a layout's `dims` (`Layout.dims()`), in
    rank order: the rank is row-major in them, e.g. rank = (d * tp + t) * pp + p."""

    def picks(n: int) -> list[int]:
        return sorted({c for c in (0, 1, n // 2, n - 2, n - 1) if 0 <= c < n})

    out = {}
    for coords in itertools.product(*(picks(n) for n in dims.values())):
        rank = 0
        for c, n in zip(coords, dims.values(), strict=True):
            rank = rank * n + c
        out[rank] = dict(zip(dims, coords, strict=True))
    return sorted(out.items())


# ------------------------------------------------------------------------------------ fake world
@contextmanager
def fake_world(rank: int, world: int) -> Iterator[None]:
    """torch's fake process group for one rank of `world`: collectives return at once, no peers.

    DTensor's sharding propagation caches (Python and C++) key an op's output spec on the inputs'
    meshes, and meshes compare equal across ranks (same layout and rank map, whatever the rank):
    without clearing them, every rank simulated after the first got DTensors on the first rank's
    mesh, with its coordinate: the local shards (FSDP cuts them from its own rank) were right, the
    DTensors' global offsets (DCP's chunks) were the first rank's."""
    import torch.distributed as dist
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    _clear_sharding_prop_cache()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()
        _clear_sharding_prop_cache()


def fake_env(rank: int, world: int, per_node: int) -> Any:
    """The rank's DistEnv: a CPU mesh device (meta tensors stay on meta through setup), backend fake."""
    import torch

    from disttrain.dist import DistEnv

    return DistEnv(rank, rank % per_node, world, per_node, "fake", torch.device("cpu"))


def setup_rank(run: Run, rank: int, world: int) -> tuple[Any, Any]:
    """(strategy, model after its real setup_module) for `rank`, the model built on meta."""
    import torch

    from disttrain.models import build_model
    from disttrain.strategies import build_strategy

    env = fake_env(rank, world, run.world.nproc_per_node)
    with torch.device("meta"):
        model = build_model(run.model)
    strategy = build_strategy(run.strategy, env, run.amp)
    return strategy, strategy.setup_module(model)


# ------------------------------------------------------------------------------------ torch's private names
def fake_tensors() -> Any:
    """A `FakeTensorMode` (shapes and dtypes, no storage) that takes real tensors as inputs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def __getattr__(name: str) -> Any:
    """`TorchDispatchMode`, the base of a mode that sees every op torch dispatches (the collective
    counter), imported on first use: the module stays importable without torch loaded."""
    if name == "TorchDispatchMode":
        from torch.utils._python_dispatch import TorchDispatchMode

        return TorchDispatchMode
    raise AttributeError(name)


def flatten_state_dict(state: dict[str, Any]) -> dict[str, Any]:
    """A nested state dict as DCP flattens it before planning ({dotted fqn: tensor or object})."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict as flatten

    flat, _ = flatten(state)
    return dict(flat)


def root_mesh(mesh: Any) -> Any:
    """The DeviceMesh a sub-mesh was sliced from (itself for a root mesh)."""
    return mesh._get_root_mesh()


def local_shape_and_offset(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], coordinate: list[int], placements: Any
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offset) of a DTensor's shard at mesh `coordinate`: what
    `DTensor.__create_chunk_list__` computes on a live rank, for any rank."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    found: tuple[tuple[int, ...], tuple[int, ...]] = _compute_local_shape_and_global_offset(
        shape, mesh_shape, coordinate, placements
    )
    return found
