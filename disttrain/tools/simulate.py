"""`disttrain plan --simulate`: rehearse the configured layout on a laptop, rank by rank.

`plan` does shape arithmetic; this runs the strategy's real setup (`build_strategy` + `setup_module`:
DeviceMesh, `fully_shard`, `parallelize_module`, the pipeline split) for sampled ranks of the
configured world on torch's fake process group, with the model built on the meta device, so no
weight is ever allocated. Per sampled rank it measures the local shards and compares them with
`plan`'s per-rank bytes; for one rank it then runs one training step under `FakeTensorMode` (shapes
only) and counts the collectives torch issues.

In process, not in a child: the `plan` parent starts no ranks and holds no other process group,
each rank's fake group is destroyed before the next, and a child would pay a second torch import
(seconds) to isolate nothing.

Which ranks: rank 0, the last rank, and along each dimension of the (dp, tp, pp) layout the
coordinates first, second, middle, second-to-last and last (their cross product, at most 25 ranks
in 2D). Those are the classes whose shards can differ: `torch.chunk` gives earlier ranks the larger
shard of an uneven dimension (the last may hold less or nothing), and earlier pipeline stages take
the extra layers.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from disttrain.config.errors import ConfigError
from disttrain.tools.fake_world import (
    MAX_WORLD,
    configured_layout,
    fake_env,
    fake_tensors,
    fake_world,
    sample_ranks,
    setup_rank,
)

if TYPE_CHECKING:
    from disttrain.config.run import Run

__all__ = ["MAX_WORLD", "configured_layout", "fake_world", "render", "sample_ranks", "setup_rank", "simulate"]
TOLERANCE = 0.05  # simulated vs plan's per-rank state bytes
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")
TP_DIM = "tp"  # the mesh dimension tensor parallelism shards over (disttrain's meshes name it so)


@dataclass
class Problem:
    """One thing that would fail at this layout: on which ranks, and the config key to change."""

    key: str
    message: str
    ranks: list[int] = field(default_factory=list)


@dataclass
class RankResult:
    rank: int
    coords: dict[str, int]
    local_params: int  # parameters (elements) this rank holds: local shards
    stored_bytes: int  # those parameters as stored (fp32 master weights under FSDP's mixed precision)
    bytes: dict[str, float]  # plan's accounting: params, grads, optimizer, total
    plan_total: float
    largest_unit: float = 0.0  # bytes of the largest FSDP unit once all-gathered (compute dtype)
    on_meta: bool = True

    @property
    def deviation(self) -> float:
        return self.bytes["total"] / self.plan_total - 1 if self.plan_total else 0.0


# ------------------------------------------------------------------------------------ measuring
def local_numel(model: Any) -> tuple[int, int, int, bool]:
    """(elements, trainable elements, stored bytes, all on meta) of this rank's unique parameters."""
    from torch.distributed.tensor import DTensor

    seen: set[int] = set()
    n = trainable = stored = 0
    meta = True
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        t = p.to_local() if isinstance(p, DTensor) else p
        n += t.numel()
        trainable += t.numel() if p.requires_grad else 0
        stored += t.numel() * t.element_size()
        meta = meta and t.is_meta
    return n, trainable, stored, meta


def gathered_numel(p: Any) -> int:
    """Elements of `p` once FSDP all-gathers it: its global size, less what tensor parallelism
    keeps sharded (a mesh dimension named tp)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return int(p.numel())
    n = int(p.numel())
    names = p.device_mesh.mesh_dim_names or ()
    for dim, placement in enumerate(p.placements):
        if placement.is_shard() and dim < len(names) and names[dim] == TP_DIM:
            n //= p.device_mesh.size(dim)
    return n


def largest_unit_numel(model: Any) -> int:
    """Elements of the largest FSDP unit after its all-gather: what one rank holds in full at once
    on top of its shards (a unit manages its parameters not inside a nested unit)."""
    from torch import nn
    from torch.distributed.fsdp import FSDPModule

    def is_unit(m: nn.Module) -> bool:  # a predicate, not isinstance inline: units stay nn.Modules
        return isinstance(m, FSDPModule)

    units = [m for m in model.modules() if is_unit(m)]
    best = 0
    for u in units:
        inner = {id(p) for c in u.modules() if c is not u and is_unit(c) for p in c.parameters()}
        seen: set[int] = set()
        size = 0
        for p in u.parameters():
            if id(p) in inner or id(p) in seen:
                continue
            seen.add(id(p))
            size += gathered_numel(p)
        best = max(best, size)
    return best


def measure(
    rank: int, coords: dict[str, int], model: Any, prec: dict[str, Any], plan_total: float
) -> RankResult:
    """The rank's state in plan's accounting (elements x plan's bytes per element), so the two agree
    exactly when the shards are what the plan assumed and differ by what it leaves out (replicated
    norms under tp, uneven shards, unbalanced pipeline stages)."""
    n, trainable, stored, meta = local_numel(model)
    b = {
        "params": float(n * prec["params"]),
        "grads": float(trainable * prec["grads"]),
        "optimizer": float(trainable * prec["optimizer_bytes"]),
    }
    b["total"] = b["params"] + b["grads"] + b["optimizer"]
    unit = float(largest_unit_numel(model) * prec["params"])
    return RankResult(rank, coords, n, stored, b, plan_total, unit, meta)


# ------------------------------------------------------------------------------------ problems
def _get(plain: dict[str, Any], key: str) -> Any:
    node: Any = plain
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def setup_key(run: Run) -> str:
    """The key a failed setup points at: the strategy's own degree knob, else the world shape."""
    s = run.strategy
    if getattr(s, "split_points", None):
        return "strategy.split_points"
    for key in ("stages_per_rank", "tp_degree", "wrap_classes"):
        if hasattr(s, key):
            return f"strategy.{key}"
    replicate = getattr(s, "replicate", None)
    return "strategy.replicate" if isinstance(replicate, int) and replicate > 1 else "strategy"


def fit_problem(run: Run, r: RankResult, act: float, usable: float) -> Problem | None:
    """Does the rank fit the device: shards + the largest gathered unit + activations <= usable?"""
    from disttrain.tools.render import human_bytes as gb

    wraps = hasattr(run.strategy, "wrap_classes")
    if r.largest_unit > usable:
        key = "strategy.wrap_classes" if wraps else "strategy.tp_degree"
        fix = (
            "wrap smaller units: strategy.wrap_classes=[Block] (a transformer block's class) or a lower "
            "strategy.min_num_params"
            if wraps
            else "a larger strategy.tp_degree splits the unit further"
        )
        return Problem(
            key,
            f"one FSDP unit all-gathers to {gb(r.largest_unit)} > {gb(usable)} usable on the device "
            f"(plan.gpu_mem_gb x plan.usable_fraction); {fix}",
        )
    need = r.bytes["total"] + r.largest_unit + act
    if need > usable:
        return Problem(
            "nodes",
            f"shards {gb(r.bytes['total'])} + largest gathered unit {gb(r.largest_unit)} + activations "
            f"{gb(act)} = {gb(need)} > {gb(usable)} usable; more ranks shard further (nodes, "
            "nproc_per_node), or set plan.activation_checkpointing / a smaller plan.micro_batch",
        )
    return None


def raise_problems(run: Run, problems: list[Problem]) -> None:
    """All problems as one paragraph, keyed by the first; exit 2 through the CLI."""
    if not problems:
        return
    first = problems[0]
    lines = [f"rank(s) {_ranks(p.ranks)}: (rank {p.ranks[0]}) {p.message} (key {p.key})" for p in problems]
    raise ConfigError(
        first.key,
        _get(run.to_dict(), first.key),
        "a value for which every simulated rank sets up and fits",
        "plan --simulate ran the strategy's setup on a fake process group: " + "; ".join(lines),
    )


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (f" (+{len(ranks) - 8} more)" if len(ranks) > 8 else "")


def _merge(problems: list[Problem], new: Problem, rank: int) -> None:
    """One problem per key: the first rank's numbers, every rank it hits."""
    for p in problems:
        if p.key == new.key:
            p.ranks.append(rank)
            return
    new.ranks.append(rank)
    problems.append(new)


# ------------------------------------------------------------------------------------ one step
class CollectiveCounter:
    """Counts the collective ops (c10d and functional collectives) torch dispatches in a region."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def mode(self) -> Any:
        from disttrain.tools.fake_world import TorchDispatchMode

        counts = self.counts

        from torch.distributed.tensor import DTensor

        class _Count(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                if any(issubclass(t, DTensor) for t in types):
                    # let DTensor desugar the op first, so the collectives it issues pass through
                    # here (CommDebugMode's trick; its module tracker trips over FSDP's hooks)
                    return NotImplemented
                if func.namespace in COLLECTIVE_NAMESPACES and "wait" not in func.__name__:
                    counts[str(func.overloadpacket).split(".", 1)[-1].strip("_")] += 1
                return func(*args, **(kwargs or {}))

        return _Count()


def step_collectives(run: Run, rank: int, world: int, batch: int) -> dict[str, Any]:
    """One training step (forward + backward, clip, optimizer) of `rank` under FakeTensorMode.

    The model is built from fake tensors (shapes, no storage) and set up by the real strategy
    outside the mode (the DeviceMesh needs real rank lists); the step runs inside it. Returns the
    collectives by phase, or why there is no step.
    """
    from disttrain.engine.optim import build_optimizer
    from disttrain.models import build_model
    from disttrain.strategies import build_strategy
    from disttrain.tasks import build_task

    sample = sample_batch(run, batch)
    if isinstance(sample, str):
        return {"skipped": sample}
    env = fake_env(rank, world, run.world.nproc_per_node)
    fake = fake_tensors()
    phases: dict[str, dict[str, int] | str] = {}
    with fake_world(rank, world):
        with fake:
            model = build_model(run.model)
        strategy = build_strategy(run.strategy, env, run.amp)
        model = strategy.setup_module(model)
        dp = strategy.data_parallel_rank_size()[1]
        task = build_task(run.task).setup(env.device)
        with fake:
            optimizer = strategy.setup_optimizer(build_optimizer(run.optim, model, dp))
            inputs, target = task.unpack(sample)
            for phase, call in (
                ("forward+backward", lambda: strategy.forward_backward(model, inputs, target, task, 1.0)),
                ("clip", lambda: strategy.clip_grad_norm(model, 1.0)),
                ("optimizer", optimizer.step),
            ):
                counter = CollectiveCounter()
                try:
                    with counter.mode():
                        call()
                except Exception as exc:  # a data-dependent branch (.item()) cannot run on shapes only
                    phases[phase] = f"not simulated ({_said(exc)[:80]})"
                    continue
                phases[phase] = dict(sorted(counter.counts.items()))
    return {"rank": rank, "phases": phases}


def sample_batch(run: Run, batch: int) -> Any:
    """`batch` real training samples, collated (FakeTensorMode takes them as inputs), or why not."""
    from torch.utils.data import default_collate

    from disttrain.data import build_datasets
    from disttrain.data.streams import first_samples

    try:
        train, _ = build_datasets(run.data)
        samples = first_samples(train, batch)
    except Exception as exc:
        return f"the data set could not be read ({type(exc).__name__})"
    if not samples:
        return "the training set is empty"
    return default_collate([samples[i % len(samples)] for i in range(batch)])


STEP_NOTICE_S = 5.0  # a step on fake tensors that takes longer says so, with the way to skip it


@contextmanager
def slow_step_notice(after_s: float) -> Iterator[None]:
    """One warning on disttrain's logger (the console) if the one-step rehearsal is still running
    after `after_s` seconds: a deep model's step (review 2026-11-28 D24: 300 layers ~2 min, 1000
    layers > 10 min) ran silently."""
    import threading

    from disttrain.observe.log import get_logger

    def say() -> None:
        get_logger().warning(
            "plan --simulate: still stepping the model once on fake tensors (%.0f s so far; deep models "
            "take minutes). HINT: --no-step skips the collectives of one step; the memory rehearsal "
            "is done.",
            after_s,
        )

    timer = threading.Timer(after_s, say)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


# ------------------------------------------------------------------------------------ main
def simulate(
    run: Run,
    plan_result: dict[str, Any],
    step: bool = True,
    load_at: Run | None = None,
) -> dict[str, Any]:
    """Run the configured strategy's setup for the sampled ranks; ConfigError naming rank and key
    for whatever would fail (setup, device memory, the model checks). `load_at`: the config of a
    layout that loads this one's checkpoint (simulate_load plans that load)."""
    from disttrain.strategies import specs

    world = run.world.size
    if world > MAX_WORLD:
        raise ConfigError(
            "nodes",
            run.world.nodes,
            f"nodes x nproc_per_node <= {MAX_WORLD} for plan --simulate (here {world})",
            "simulate a smaller world with the same per-node shape, or run plan without --simulate.",
        )
    lay, layout = configured_layout(run, plan_result)
    prec, usable = plan_result["precision"], plan_result["usable_bytes"]
    plan_state = layout["bytes"]["total"] - layout["bytes"]["activations"]
    act = layout["bytes"]["activations"]
    replica = lay.zero < 2 and lay.tp == lay.pp == 1
    ranks = sample_ranks(lay.dims())
    problems: list[Problem] = []
    results: list[RankResult] = []
    if not replica:  # ddp-family wrappers broadcast real weights: nothing to rehearse on meta
        for rank, coords in ranks:
            with fake_world(rank, world):
                try:
                    _, model = setup_rank(run, rank, world)
                except Exception as exc:
                    _merge(problems, Problem(setup_key(run), f"setup failed: {_said(exc)}"), rank)
                    continue
                r = measure(rank, coords, model, prec, plan_state)
            results.append(r)
            fit = fit_problem(run, r, act, usable)
            if fit is not None:
                _merge(problems, fit, rank)
    raise_problems(run, problems)
    _model_checks(run)
    collectives: dict[str, Any] = {"skipped": "whole replicas: ddp's one gradient all-reduce per step"}
    if not replica and not step:
        collectives = {"skipped": "--no-step"}
    elif not replica and lay.pp > 1:
        collectives = {"skipped": "pipeline schedules (P2P between stages) are not stepped"}
    elif not replica:
        with slow_step_notice(STEP_NOTICE_S):
            collectives = step_collectives(run, 0, world, int(plan_result["micro_batch"]))
    load = None
    if load_at is not None:
        from disttrain.tools.simulate_load import simulate_load

        load = simulate_load(run, load_at)
    return {
        "layout": {k: v for k, v in layout.items() if k != "bytes"},
        "plan_bytes": layout["bytes"],
        "rehearsed": not replica,
        "ranks": [
            {
                "rank": r.rank,
                "coords": r.coords,
                "bytes": r.bytes,
                "plan_total": r.plan_total,
                "deviation": r.deviation,
                "agrees": abs(r.deviation) <= TOLERANCE,
                "largest_unit_bytes": r.largest_unit,
                "stored_param_bytes": r.stored_bytes,
                "on_meta": r.on_meta,
            }
            for r in results
        ],
        "collectives": collectives,
        "spec": specs.of(run)[0].name,
        **({"load": load} if load is not None else {}),
    }


def _model_checks(run: Run) -> None:
    """The pre-launch model checks (tp heads, pipeline layers) on a meta model, after the setups
    so a failing setup is named by its rank first."""
    import torch

    from disttrain.models import build_model
    from disttrain.strategies import specs

    spec, s = specs.of(run)
    if spec.check_model is None:
        return
    with torch.device("meta"):
        model = build_model(run.model)
    spec.check_model(run, s, model, 0)


def _said(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else "(no message)"
    return f"{type(exc).__name__}: {text}"


def render(sim: dict[str, Any]) -> None:
    from disttrain.strategies.specs.layout import DIMS
    from disttrain.tools.render import console, human_bytes, table

    out = console()
    lay = sim["layout"]
    dims = [d for d in DIMS if d in lay]
    out.print(
        f"simulated {sim['spec']}: {' x '.join(f'{d} {lay[d]}' for d in dims)} (ZeRO-{lay['zero']}, "
        f"shards of {lay['shard']}) on torch's fake process group, model on the meta device"
    )
    if not sim["rehearsed"]:
        out.print("whole replicas on every rank: setup not rehearsed (plan's numbers are exact here)")
    rows = [
        (
            str(r["rank"]),
            "/".join(str(c) for c in r["coords"].values()),
            *(human_bytes(r["bytes"][k]) for k in ("params", "grads", "optimizer", "total")),
            human_bytes(r["plan_total"]),
            f"{100 * r['deviation']:+.1f}%",
            human_bytes(r["largest_unit_bytes"]),
        )
        for r in sim["ranks"]
    ]
    cols = [
        "rank",
        "/".join(dims),
        ">params",
        ">grads",
        ">optimizer",
        ">total",
        ">plan",
        ">vs plan",
        ">largest unit",
    ]
    out.print(table("per sampled rank: local shards x plan's bytes per element", cols, rows))
    off = [r["rank"] for r in sim["ranks"] if not r["agrees"]]
    if off:
        out.print(
            f"ranks {_ranks(off)} differ from plan by more than {TOLERANCE:.0%} (plan assumes even splits)"
        )
    coll = sim["collectives"]
    if "skipped" in coll:
        out.print(f"collectives of one step: not simulated ({coll['skipped']})")
    else:
        parts = [
            f"{phase}: "
            + (ops if isinstance(ops, str) else ", ".join(f"{n} x {op}" for op, n in ops.items()) or "none")
            for phase, ops in coll["phases"].items()
        ]
        out.print(f"collectives of one step on rank {coll['rank']} (FakeTensorMode): " + "; ".join(parts))
    if "load" in sim:
        from disttrain.tools.simulate_load import render as render_load

        render_load(sim["load"])
