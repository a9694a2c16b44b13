"""`plan --simulate --load-at OVERRIDES`: a checkpoint saved at world W, planned for a load at W'.

DCP plans a load from the checkpoint's `Metadata` (every tensor's global shape and the chunks each
saved rank wrote) and the loading rank's state dict. Both are built here with DCP's own planners on
meta tensors, so nothing is allocated and nothing is written:

- save side (world W): rank 0 of W runs the strategy's real setup on the fake process group and
  its `strategy.state_dict` (model + optimizer, as a checkpoint saves it) goes through
  `DefaultSavePlanner` (flattening, write items). The other W - 1 ranks' plans are rank 0's with
  each DTensor's chunk recomputed for that rank's mesh coordinate from the global shape and the
  placements (`_compute_local_shape_and_global_offset`, what `DTensor.__create_chunk_list__` runs
  on a live rank): setting up 1,024 ranks would take minutes, the geometry takes milliseconds.
  Rank 0's plan is the only one DCP builds itself; tests check the recomputation against it.
  `DefaultSavePlanner.create_global_plan` then deduplicates replicated items (one rank writes each,
  the one with the smallest plan so far), validates that the chunks tile every tensor, and gives
  the `Metadata`; a saved rank's file (`__R_*.distcp`) holds the items of its deduplicated plan.
- load side (world W'): each sampled rank of W' sets up on the fake process group and
  `create_default_local_load_plan` (one key at a time, so every failing tensor is named) gives its
  `ReadItem`s. A resharded read loads the whole saved chunk and narrows it (DCP's FileSystemReader;
  disttrain's reader reads whole chunks the same way), so the bytes read from files can exceed
  the bytes the rank keeps.

Layouts whose ranks hold different keys (pipeline stages) or whose strategy saves its own format
(zero, localsgd) are not simulated; replica layouts (ddp, dp, single) save the whole model from
every rank, which is the module's own state dict, so they need no strategy setup.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import TYPE_CHECKING, Any

from disttrain.config.errors import ConfigError

if TYPE_CHECKING:
    from disttrain.config.run import Run
    from disttrain.strategies.specs import Layout


# ------------------------------------------------------------------------------------ overrides
def target_overrides(base: list[str], load_at: list[str]) -> list[str]:
    """The load layout's overrides: the saved run's, with `load_at` winning. A config group the
    load layout selects again (`strategy=fsdp`) drops the saved run's keys inside it
    (`strategy.tp_degree=8`), which the other group may not have."""
    keys = {o.split("=", 1)[0].lstrip("+~") for o in load_at}
    groups = {k for k in keys if "." not in k}

    def kept(o: str) -> bool:
        key = o.split("=", 1)[0].lstrip("+~")
        return key not in keys and key.split(".", 1)[0] not in groups

    return [o for o in base if kept(o)] + list(load_at)


# ------------------------------------------------------------------------------------ one rank
def rank_state(run: Run, rank: int, world: int, spec: str) -> dict[str, Any]:
    """The flattened state a checkpoint saves from `rank` (model + optimizer, on meta), inside
    that rank's fake process group: {fqn: tensor, DTensor or object}."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from disttrain.engine.optim import build_optimizer
    from disttrain.models import build_model
    from disttrain.strategies import specs
    from disttrain.tools.fake_world import flatten_state_dict, setup_rank

    if specs.get(spec).replicated:  # every rank's state dict is the plain module's
        with torch.device("meta"):
            model = build_model(run.model)
        optimizer = build_optimizer(run.optim, model, world)
        model_state, optim_state = get_state_dict(model, optimizer)
        state: dict[str, Any] = {"model": model_state, "optim": optim_state}
    else:
        strategy, model = setup_rank(run, rank, world)
        dp = strategy.data_parallel_rank_size()[1]
        optimizer = strategy.setup_optimizer(build_optimizer(run.optim, model, dp))
        state = strategy.state_dict(model, optimizer)
    return flatten_state_dict({"model": state})  # the checkpoint's app state names it "model"


def supported(spec: str, layout: Layout) -> str | None:
    """Why a layout's save or load is not simulated, or None."""
    from disttrain.strategies import specs

    if layout.pp > 1:
        return f"{spec}: each pipeline stage saves other keys"
    if not specs.get(spec).dcp_layout:
        return f"{spec} saves its own state format (its strategy's state_dict)"
    return None


# ------------------------------------------------------------------------------------ save side
def _coordinates(mesh: Any) -> dict[int, tuple[int, ...]]:
    """Every global rank's coordinate in `mesh` (a sub-mesh: its dims of the root mesh)."""
    from disttrain.tools.fake_world import root_mesh

    root = root_mesh(mesh)
    names, root_names = mesh.mesh_dim_names, root.mesh_dim_names
    if mesh is root or names is None:
        dims = list(range(mesh.ndim))
    elif root_names is not None and all(n in root_names for n in names):
        dims = [root_names.index(n) for n in names]
    else:
        # disttrain's strategies slice their meshes by name; a flattened or unnamed sub-mesh has
        # no coordinate to read here: the layout is reported as not simulated
        raise ValueError(f"mesh dims {names} are not dims of the root mesh {root_names}")
    full = root.mesh
    return {
        int(full[idx]): tuple(idx[d] for d in dims)
        for idx in itertools.product(*(range(s) for s in full.shape))
    }


def save_plans(local_plan: Any, state: dict[str, Any], world: int) -> list[Any]:
    """The local SavePlan of every rank of `world`: rank 0's (from DCP), each DTensor's chunk
    recomputed for the rank's mesh coordinate; plain tensors and objects as every rank writes them."""
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.tensor import DTensor

    from disttrain.tools.fake_world import local_shape_and_offset

    meshes: dict[int, dict[int, tuple[int, ...]]] = {}
    geometry: dict[str, tuple[Any, ...]] = {}
    for fqn, obj in state.items():
        if isinstance(obj, DTensor):
            mesh = obj.device_mesh
            coords = meshes.setdefault(id(mesh), _coordinates(mesh))
            geometry[fqn] = (tuple(obj.shape), tuple(mesh.shape), tuple(obj.placements), coords)
    chunks: dict[tuple[Any, ...], tuple[tuple[int, ...], tuple[int, ...]]] = {}
    plans = []
    for rank in range(world):
        items = []
        for item in local_plan.items:
            geo = geometry.get(item.index.fqn)
            if geo is None:
                items.append(item)
                continue
            shape, mesh_shape, placements, coords = geo
            if rank not in coords:
                continue  # outside this tensor's mesh: writes nothing of it
            key = (shape, mesh_shape, placements, coords[rank])
            if key not in chunks:
                chunks[key] = local_shape_and_offset(shape, mesh_shape, list(coords[rank]), placements)
            sizes, offsets = chunks[key]
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            items.append(
                dataclasses.replace(
                    item,
                    index=MetadataIndex(item.index.fqn, torch.Size(offsets)),
                    tensor_data=dataclasses.replace(item.tensor_data, chunk=chunk),
                )
            )
        plans.append(dataclasses.replace(local_plan, items=items))
    return plans


@dataclasses.dataclass
class Saved:
    """The checkpoint a save at `world` writes, as DCP's coordinator plans it."""

    world: int
    metadata: Any  # torch.distributed.checkpoint.metadata.Metadata
    writer: dict[Any, int]  # MetadataIndex of a saved chunk -> the saved rank whose file holds it
    local_plans: list[Any]  # every rank's, before deduplication
    rank0: Any  # the local plan DCP made on rank 0 (tests compare the recomputed ones with DCP's)

    def tensor_bytes(self) -> int:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        return sum(
            math.prod(md.size) * _itemsize(md.properties.dtype)
            for md in self.metadata.state_dict_metadata.values()
            if isinstance(md, TensorStorageMetadata)
        )


def plan_save(run: Run, world: int, spec: str) -> Saved:
    """DCP's global save plan for a checkpoint of `run` saved by all `world` ranks."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from disttrain.tools.fake_world import fake_world

    with fake_world(0, world):
        state = rank_state(run, 0, world, spec)
        planner = DefaultSavePlanner(flatten_state_dict=False)  # flattened above, as DCP's would
        planner.set_up_planner(state, None, True)
        local = planner.create_local_plan()
        plans = save_plans(local, state, world)
    global_plans, metadata = planner.create_global_plan(plans)
    writer = {item.index: r for r, p in enumerate(global_plans) for item in p.items}
    return Saved(world, metadata, writer, plans, local)


# ------------------------------------------------------------------------------------ load side
@dataclasses.dataclass
class LoadResult:
    rank: int
    coords: dict[str, int]
    needed: int = 0  # tensor bytes this rank keeps (the overlaps of its shards with saved chunks)
    read: int = 0  # tensor bytes it loads from files: every saved chunk it overlaps, whole
    objects: int = 0  # non-tensor values (optimizer hyperparameters) it reads
    saved_ranks: set[int] = dataclasses.field(default_factory=set)
    # fqn -> saved ranks it reads from (tests check these by hand)
    sources: dict[str, list[int]] = dataclasses.field(default_factory=dict)


def _itemsize(dtype: Any) -> int:
    import torch

    return torch.empty((), dtype=dtype, device="meta").element_size()


def _local_numel(obj: Any) -> int:
    from torch.distributed.tensor import DTensor

    return int((obj.to_local() if isinstance(obj, DTensor) else obj).numel())


def plan_load(
    saved: Saved, state: dict[str, Any], rank: int, coords: dict[str, int], problems: dict[str, list[Any]]
) -> LoadResult:
    """One W' rank's DCP load plan against `saved`; tensors it cannot load go into `problems`
    (fqn -> [why, ranks])."""
    import torch
    from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
    from torch.distributed.checkpoint.planner import LoadItemType

    md = saved.metadata.state_dict_metadata
    out = LoadResult(rank, coords)
    for fqn, obj in state.items():
        entry = md.get(fqn)
        if entry is None:  # DCP's strict load raises "Missing key in checkpoint state_dict"
            problems.setdefault(fqn, ["not in the checkpoint", []])[1].append(rank)
            continue
        if (
            isinstance(obj, torch.Tensor)
            and isinstance(entry, TensorStorageMetadata)
            and entry.size != obj.size()
        ):
            why = f"saved {list(entry.size)}, here {list(obj.size())}"  # DCP's own check, said shorter
            problems.setdefault(fqn, [why, []])[1].append(rank)
            continue
        try:
            items = create_default_local_load_plan({fqn: obj}, saved.metadata, strict=True).items
        except (RuntimeError, ValueError) as exc:
            problems.setdefault(fqn, [str(exc).splitlines()[0], []])[1].append(rank)
            continue
        if not isinstance(obj, torch.Tensor):
            out.objects += len(items)
            continue
        assert isinstance(entry, TensorStorageMetadata)
        size = _itemsize(entry.properties.dtype)
        saved_chunks = {tuple(c.offsets): c for c in entry.chunks}
        covered = 0
        for ri in items:
            if ri.type == LoadItemType.BYTE_IO:
                continue
            kept = math.prod(ri.lengths)
            covered += kept
            out.needed += kept * size
            offset = ri.storage_index.offset or torch.Size()  # a tensor's read always names its chunk
            chunk = saved_chunks[tuple(offset)]
            out.read += math.prod(chunk.sizes) * size
            src = saved.writer[MetadataIndex(fqn, offset)]
            out.saved_ranks.add(src)
            out.sources.setdefault(fqn, []).append(src)
        if covered != _local_numel(obj):
            why = f"the saved chunks cover {covered} of this rank's {_local_numel(obj)} elements"
            problems.setdefault(fqn, [why, []])[1].append(rank)
    return out


# ------------------------------------------------------------------------------------ main
def simulate_load(source: Run, target: Run, detail: bool = False) -> dict[str, Any]:
    """A save of `source`'s layout planned for a load at `target`'s, for target's sampled ranks.
    ConfigError naming each tensor that would not load (and the model key that differs).
    `detail`: each rank's entry also lists, per tensor, the saved ranks it reads from."""
    from disttrain.strategies import specs
    from disttrain.tools.fake_world import MAX_WORLD, fake_world, sample_ranks

    sides = []
    for run, key in ((source, "nodes"), (target, "--load-at nodes")):
        world = run.world.size
        if world > MAX_WORLD:
            raise ConfigError(
                key, run.world.nodes, f"nodes x nproc_per_node <= {MAX_WORLD}", "a smaller world"
            )
        spec = specs.of(run)[0].name
        sides.append((run, world, spec, specs.layout(run)))
    (_, w_save, spec_save, lay_save), (_, w_load, spec_load, lay_load) = sides
    head = {
        "saved": {"spec": spec_save, "world": w_save, **lay_save.dims()},
        "loaded": {"spec": spec_load, "world": w_load, **lay_load.dims()},
    }
    why = supported(spec_save, lay_save) or supported(spec_load, lay_load)
    if why:
        return {**head, "skipped": why}
    saved = plan_save(source, w_save, spec_save)
    problems: dict[str, list[Any]] = {}
    results = []
    asked: set[str] = set()
    for rank, coords in sample_ranks(lay_load.dims()):
        with fake_world(rank, w_load):
            state = rank_state(target, rank, w_load, spec_load)
            asked |= set(state)
            results.append(plan_load(saved, state, rank, coords, problems))
    if problems:
        raise_unloadable(source, target, saved, problems)
    md = saved.metadata.state_dict_metadata
    return {
        **head,
        "checkpoint": {
            "tensor_bytes": saved.tensor_bytes(),
            "entries": len(md),
            "chunks": len(saved.writer),
            "writing_ranks": len(set(saved.writer.values())),
        },
        "loadable": True,
        "unread": sorted(set(md) - asked),
        "ranks": [
            {
                "rank": r.rank,
                "coords": r.coords,
                "needed_bytes": r.needed,
                "read_bytes": r.read,
                "objects": r.objects,
                "saved_ranks": sorted(r.saved_ranks),
                **({"sources": r.sources} if detail else {}),
            }
            for r in results
        ],
    }


def _model_key(source: Run, target: Run) -> tuple[str, Any]:
    """The first model key whose value differs between the save and the load, else the strategy."""
    for k, v in target.model.items():
        if source.model.get(k) != v:
            return f"model.{k}", v
    return "strategy", target.strategy.name


def raise_unloadable(source: Run, target: Run, saved: Saved, problems: dict[str, list[Any]]) -> None:
    key, value = _model_key(source, target)
    lines = [
        f"{fqn}: {why} (ranks {', '.join(map(str, ranks[:8]))})" for fqn, (why, ranks) in problems.items()
    ]
    shown = "; ".join(lines[:4]) + (f"; and {len(lines) - 4} more" if len(lines) > 4 else "")
    raise ConfigError(
        key,
        value,
        "a load layout whose model has every saved tensor's global shape",
        f"a checkpoint saved at world {saved.world} does not load at this layout ({len(problems)} "
        f"tensors): {shown}. Load with the model the checkpoint was saved with.",
    )


def render(load: dict[str, Any]) -> None:
    from disttrain.tools.render import console, human_bytes, table

    out = console()
    s, d = load["saved"], load["loaded"]

    def name(side: dict[str, Any]) -> str:
        return (
            f"{side['spec']} at world {side['world']} (dp {side['dp']} x tp {side['tp']} x pp {side['pp']})"
        )

    if "skipped" in load:
        out.print(f"load of a save by {name(s)} at {name(d)}: not simulated ({load['skipped']})")
        return
    ck = load["checkpoint"]
    out.print(
        f"a checkpoint saved by {name(s)}: {human_bytes(ck['tensor_bytes'])} of tensors in {ck['chunks']} "
        f"chunks, {ck['writing_ranks']} ranks write files; loaded by {name(d)}: every tensor covered"
    )
    rows = [
        (
            str(r["rank"]),
            "/".join(str(c) for c in r["coords"].values()),
            human_bytes(r["needed_bytes"]),
            human_bytes(r["read_bytes"]),
            str(len(r["saved_ranks"])),
            _short(r["saved_ranks"]),
        )
        for r in load["ranks"]
    ]
    cols = ["rank", "dp/tp/pp", ">kept", ">read from files", ">saved ranks", "which"]
    out.print(table("per sampled loading rank: DCP's load plan (whole saved chunks are read)", cols, rows))
    if load["unread"]:
        out.print(f"{len(load['unread'])} saved entries no loading rank asks for, e.g. {load['unread'][0]}")


def _short(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:6])) + (f" (+{len(ranks) - 6})" if len(ranks) > 6 else "")
