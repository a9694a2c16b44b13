"""Strategies side by side on 2 gloo ranks: steady-state step time relative to ddp, per-rank state.

Every row is a real `disttrain train` run (the CLI, torchrun, the engine) on the same model, data,
global batch and steps; the numbers come from its metrics.jsonl and summary.json:

- step ms: steady state, (time of the last log - time of the first log at or after `--warmup`) /
  steps in between, median over `--repeats` (rows interleave across repeats);
- state bytes: parameters + gradients + optimizer state held by the fullest rank (local shards);
- allreduce bytes/step: for strategies that count them (localsgd).

Rows named `bare ...` are not disttrain: a plain torchrun script (this file, `--bare-worker`) on
the same model, data, AdamW, clipping and log cadence that calls `fully_shard` itself (every Linear
a unit, then the root, as `strategy.wrap_classes=[Linear]`) or runs a `torch.distributed.pipelining`
schedule itself (the same stage cut, the same timing of compute), so the FSDP, HSDP and pipeline
rows can be read against what FSDP2 and the pipelining schedules cost on this backend, not only
against ddp. A bare pipeline row also measures what an action costs besides compute: the gloo
point-to-point latency (half a ping-pong of one micro-batch's activation) and the schedule's own CPU
per action (thread CPU inside `step` outside the forward/backward chunks).

The pipeline rows train the 1024x4 MLP (1536 inputs: equal stages) on a global batch of 1024 so that a rank's compute for one
micro-batch is well over 10 ms at m=8 (the column `mb ms` shows it); the FSDP/HSDP rows keep batch 256.
The run ends with the verdicts against the targets of issue 16 (pipeline idle within 0.05 of
(p-1)/(v*m+p-1), interleaved faster than 1f1b at equal m, hsdp(2,1) <= 1.2x ddp, fsdp <= 2x ddp
or <= 1.05x bare FSDP2) and the machine's load before and after.

Rows are a list: a strategy (or a variant) is one `Row`; a row may add its own columns with
`extra` (e.g. a pipeline's bubble fraction), printed after the shared ones.

    python scripts/bench_strategies.py               # ~3-4 min on 2 cores
    python scripts/bench_strategies.py --quick       # fewer steps, one repeat
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WORLD = 2
BATCH = 32  # per rank; dp runs one process with WORLD x BATCH


@dataclass
class Row:
    name: str
    overrides: tuple[str, ...]
    world: int = WORLD
    extra: Callable[[Path], dict[str, str]] | None = None  # more columns from the run dir
    note: str = ""
    baseline: str = "ddp"  # the row its "vs ddp" columns divide by (same model and global batch)
    bare: dict[str, Any] | None = (
        None  # a plain script instead of disttrain: {"kind": "fsdp"|"hsdp"|"pipeline"}
    )
    steps: int | None = None  # its own step count (the big-batch pipeline rows), else --steps
    results: list[dict[str, Any]] = field(default_factory=list)


def one_process(*overrides: str) -> tuple[str, ...]:
    return ("nproc_per_node=1", f"trainer.batch_size={WORLD * BATCH}", *overrides)


# ---------------------------------------------------------------------------------- model parallel
# Pipeline and tp ranks split ONE model and read the same data: their batch is the global 2B. The
# pipeline rows train a wider MLP with 4 hidden layers on a larger batch, so that compute, not the
# schedule's per-action overhead, fills a micro-batch, and so that the 2 stages (and the 4 interleaved
# ones, cut by split_points at one Linear each) hold equal compute: the measured bubble is then
# comparable with the theory, which assumes equal stages. "ddp (pp batch)" is their baseline; the
# FSDP/HSDP rows on the same model keep global batch 256 and "ddp (pp model)" as theirs.
PP_WIDTH, PP_BATCH = 1024, 256  # global batch of the fsdp/hsdp rows on the 1024x4 model
PIPE_BATCH = 1024  # global batch of the pipeline rows: ~25 ms of a rank's compute per micro-batch at m=8
PIPE_STEPS = 30  # the pipeline rows are ~4x slower per step than the others: fewer steps
PP_MODEL = (f"data.num_features={PP_WIDTH}", f"model.hidden=[{','.join([str(PP_WIDTH)] * 4)}]")
# The first stage computes no gradient for its input, so with 1024 inputs its 2 Linears cost 5
# matmuls to the second stage's 6 (the measured bubble then holds +0.06 of imbalance at m=8). 1536
# inputs make the first Linear 1.5x: 6 = 6 for 2 stages, and 3 = 3 = 3 = 3 for the 4 interleaved ones.
PIPE_IN = 1536
PIPE_MODEL = (f"data.num_features={PIPE_IN}", PP_MODEL[1])
PP_SPLIT4 = "strategy.split_points=[layers.3,layers.5,layers.7]"
FSDP_PP = ("strategy=fsdp", "strategy.wrap_classes=[Linear]", f"trainer.batch_size={PP_BATCH // WORLD}")
MIN_MB_MS = 10.0  # the pipeline target holds where a micro-batch's stage compute is at least this
PIPE_SCHEDULES = (("gpipe", 4), ("1f1b", 4), ("1f1b", 8), ("interleaved_1f1b", 4), ("interleaved_1f1b", 8))


def bubble(run_dir: Path) -> dict[str, float]:
    """Measured idle fraction (1 - compute time / schedule time, mean over ranks), the theory and a
    rank's compute per micro-batch (ms, the slower rank)."""
    stats = json.loads((run_dir / "summary.json").read_text())["pipeline"]
    return {
        "idle meas.": stats["idle_fraction"],
        "idle theory": stats["bubble_theory"],
        "mb ms": max(stats["compute_ms_per_microbatch"]),
    }


def pipe_name(schedule: str, m: int, bare: bool = False) -> str:
    v = 2 if schedule == "interleaved_1f1b" else 1
    return ("bare " if bare else "") + f"pipeline {schedule} m={m}" + (f" v={v}" if v > 1 else "")


def pipeline_row(schedule: str, m: int) -> Row:
    v = 2 if schedule == "interleaved_1f1b" else 1
    overrides = (
        *PIPE_MODEL,
        "strategy=pipeline",
        f"strategy.schedule={schedule}",
        f"strategy.n_microbatches={m}",
        f"strategy.stages_per_rank={v}",
        f"trainer.batch_size={PIPE_BATCH}",
        *((PP_SPLIT4,) if v > 1 else ()),
    )
    return Row(pipe_name(schedule, m), overrides, extra=bubble, baseline="ddp (pp batch)", steps=PIPE_STEPS)


def bare_pipeline_row(schedule: str, m: int) -> Row:
    bare = {"kind": "pipeline", "schedule": schedule, "m": m}
    return Row(pipe_name(schedule, m, bare=True), (), baseline="ddp (pp batch)", bare=bare, steps=PIPE_STEPS)


def model_parallel_rows() -> list[Row]:
    return [
        Row("tp", ("strategy=tp", f"trainer.batch_size={WORLD * BATCH}"), note="one replica: batch 2B"),
        Row(
            "fsdp+tp (2x2)",
            ("strategy=fsdp+tp", "nproc_per_node=4", f"trainer.batch_size={BATCH}"),
            world=4,
            note="4 ranks on the same cores: oversubscribed",
        ),
        Row(
            "ddp (pp model)",
            (*PP_MODEL, "strategy=ddp", f"trainer.batch_size={PP_BATCH // WORLD}"),
            note=f"baseline of the fsdp/hsdp rows: MLP {PP_WIDTH} x4, global batch {PP_BATCH}",
        ),
        Row("fsdp (pp model)", (*PP_MODEL, *FSDP_PP), baseline="ddp (pp model)"),
        Row("bare fully_shard (pp model)", PP_MODEL, baseline="ddp (pp model)", bare={"kind": "fsdp"}),
        Row(
            "hsdp (2,1) (pp model)", (*PP_MODEL, *FSDP_PP, "strategy.replicate=2"), baseline="ddp (pp model)"
        ),
        Row("bare HSDP (2,1) (pp model)", PP_MODEL, baseline="ddp (pp model)", bare={"kind": "hsdp"}),
        Row(
            "ddp (pp batch)",
            (*PIPE_MODEL, "strategy=ddp", f"trainer.batch_size={PIPE_BATCH // WORLD}"),
            steps=PIPE_STEPS,
            note=f"baseline of the pipeline rows: MLP {PIPE_IN}->{PP_WIDTH} x4, global batch {PIPE_BATCH}",
        ),
        *(pipeline_row(sched, m) for sched, m in PIPE_SCHEDULES),
        *(bare_pipeline_row(sched, m) for sched, m in PIPE_SCHEDULES),
    ]


ROWS: list[Row] = [
    Row("ddp", ("strategy=ddp",)),
    Row("ddp fp16 hook", ("strategy=ddp", "strategy.comm_hook=fp16")),
    Row("zero", ("strategy=zero",)),
    Row("fsdp", ("strategy=fsdp", "strategy.wrap_classes=[Linear]")),
    Row(
        "fsdp no-reshard",
        ("strategy=fsdp", "strategy.wrap_classes=[Linear]", "strategy.reshard_after_forward=false"),
    ),
    Row("hsdp (2,1)", ("strategy=hsdp", "strategy.wrap_classes=[Linear]")),
    Row("localsgd N=4", ("strategy=localsgd", "strategy.sync_every=4")),
    Row("dp (1 proc)", one_process("strategy=dp"), world=1, note="CPU: one process, no parallelism"),
    Row("single (1 proc)", one_process("strategy=single"), world=1, note="reference, batch 2B"),
    *model_parallel_rows(),
]


def steps_of(row: Row, args: argparse.Namespace) -> tuple[int, int]:
    """(steps, first timed step) of a row: its own step count if it has a smaller one."""
    steps = args.steps if row.steps is None else min(row.steps, args.steps)
    return steps, min(args.warmup, steps // 4)


def run(row: Row, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix=row.name.split()[0] + "_", dir=root))
    if row.bare is not None:
        return run_bare(row, args, folder)
    steps, warmup = steps_of(row, args)
    cmd = [
        shutil.which("disttrain") or "disttrain",
        "train",
        "data=synthetic",
        "data.val=null",
        f"data.num_features={args.width}",
        f"model.hidden=[{args.width},{args.width},{args.width}]",
        "sched=constant",
        f"trainer.max_steps={steps}",
        f"trainer.log_every={args.log_every}",
        f"trainer.batch_size={BATCH}",
        "trainer.progress=false",
        "threads_per_rank=1",
        "hydra.run.dir=run",
        *row.overrides,
    ]
    proc = subprocess.run(cmd, cwd=folder, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise SystemExit(f"{row.name}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    run_dir = folder / "run"
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    summary = json.loads((run_dir / "summary.json").read_text())
    by_rank, allreduce = summary["state_bytes_by_rank"], summary.get("allreduce_bytes_per_step")
    out = result_row(records, warmup, "train/loss", max(by_rank), allreduce)
    if row.extra is not None:
        out["extra"] = row.extra(run_dir)
    shutil.rmtree(folder, ignore_errors=True)
    return out


def run_bare(row: Row, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """The same model through a plain torchrun + fully_shard/pipelining script (see the module docstring)."""
    assert row.bare is not None
    steps, warmup = steps_of(row, args)
    pipe = row.bare["kind"] == "pipeline"
    opts = {
        **vars(args),
        **row.bare,
        "steps": steps,
        "warmup": warmup,
        "width": PP_WIDTH,
        "in_features": PIPE_IN if pipe else PP_WIDTH,
        "layers": 4,
        "batch": PIPE_BATCH if pipe else PP_BATCH // WORLD,  # a pipeline's ranks read the same batch
    }
    out = folder / "result.json"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}",
        __file__, "--bare-worker", json.dumps(opts), str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=_one_thread())
    if proc.returncode != 0:
        raise SystemExit(f"{row.name}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    result = json.loads(out.read_text())
    shutil.rmtree(folder, ignore_errors=True)
    return result


def result_row(
    records: list[dict[str, Any]], warmup: int, loss: str, state: int, allreduce: int | None = None
) -> dict[str, Any]:
    """One measured result: ms per step between the first and the last log at or after `warmup`
    (records holding `loss`), the fullest rank's state bytes, all-reduce bytes per step, final loss."""
    timed = [r for r in records if loss in r and r["step"] >= warmup]
    first, last = timed[0], timed[-1]
    return {
        "step_ms": 1000 * (last["time"] - first["time"]) / max(last["step"] - first["step"], 1),
        "state_bytes": state,
        "allreduce_per_step": allreduce,
        "final_loss": last[loss],
    }


def state_bytes(params: list[Any], optimizer: Any) -> int:
    """Parameters + gradients + optimizer state this rank holds (a DTensor counts its local shard)."""
    import torch
    from torch.distributed.tensor import DTensor

    def local(t: torch.Tensor) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    states = [v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
    return 2 * sum(local(p) for p in params) + sum(local(v) for v in states)


def _one_thread() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def bare_worker(opts: dict[str, Any], out: str) -> None:
    """One rank of the plain FSDP2 loop: disttrain's MLP and synthetic data, nothing of its engine."""
    if opts["kind"] == "pipeline":
        bare_pipeline_worker(opts, out)
        return
    import time

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.utils.data import DataLoader, DistributedSampler

    from disttrain.data.synthetic import make_synthetic
    from disttrain.models.mlp import MLP

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    width, steps = opts["width"], opts["steps"]
    data = make_synthetic(steps * opts["batch"] * world, width, 4, seed=1234)
    torch.manual_seed(0)
    model = MLP(width, 4, [width] * opts["layers"])
    if opts["kind"] == "hsdp":
        mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    dp_rank, dp_world = (rank, world)
    sampler = DistributedSampler(data, dp_world, dp_rank, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(data, batch_size=opts["batch"], sampler=sampler, drop_last=True)
    records, loss_sum = [], torch.zeros(())
    for step, (x, y) in enumerate(loader, start=1):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_sum += loss.detach()
        if step % opts["log_every"] == 0 or step == steps:
            dist.all_reduce(loss_sum)
            records.append({"step": step, "time": time.time(), "loss": loss_sum.item() / world})
            loss_sum = torch.zeros(())
        if step == steps:
            break

    by_rank: list[Any] = [None] * world
    dist.all_gather_object(by_rank, state_bytes(list(model.parameters()), optimizer))
    if rank == 0:
        Path(out).write_text(json.dumps(result_row(records, opts["warmup"], "loss", max(by_rank))))
    dist.destroy_process_group()


def bare_pipeline_worker(opts: dict[str, Any], out: str) -> None:
    """One rank of a plain `torch.distributed.pipelining` loop on disttrain's MLP, cut as disttrain
    cuts it, its compute timed as disttrain times it; plus what an action costs besides compute."""
    import time

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )
    from torch.utils.data import DataLoader

    from disttrain.data.synthetic import make_synthetic
    from disttrain.models.mlp import MLP

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    width, steps, m, batch = opts["width"], opts["steps"], opts["m"], opts["batch"]
    v = 2 if opts["schedule"] == "interleaved_1f1b" else 1
    n_stages = world * v
    torch.manual_seed(0)
    layers = list(MLP(opts["in_features"], 4, [width] * opts["layers"]).layers.children())
    # disttrain's cut: the 10 layers halved for 2 stages; one hidden Linear each for 4 (PP_SPLIT4)
    bounds = {1: [0, 5, 10], 2: [0, 3, 5, 7, 10]}[v]
    assert len(layers) == bounds[-1] and world == 2, (len(layers), world)
    local = [s for s in range(n_stages) if s % world == rank]
    modules = {s: nn.Sequential(*layers[bounds[s] : bounds[s + 1]]) for s in local}
    busy = [0.0, 0.0]  # wall and thread CPU seconds inside forward/backward chunks

    def timed(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*a: Any, **k: Any) -> Any:
            started, cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                busy[0] += time.perf_counter() - started
                busy[1] += time.thread_time() - cpu

        return wrapper

    stages = []
    for s in local:
        stage = PipelineStage(modules[s], s, n_stages, torch.device("cpu"))
        stage.forward_one_chunk = timed(stage.forward_one_chunk)  # type: ignore[method-assign]
        stage.backward_one_chunk = timed(stage.backward_one_chunk)  # type: ignore[method-assign]
        stages.append(stage)

    @timed  # the last stage's loss is its compute too, as in disttrain
    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output, target) / m

    kw: dict[str, Any] = {"loss_fn": loss_fn, "scale_grads": False}
    if v > 1:
        schedule: Any = ScheduleInterleaved1F1B(stages, m, **kw)
    else:
        schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[opts["schedule"]](stages[0], m, **kw)
    params = [p for mod in modules.values() for p in mod.parameters()]
    optimizer = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)
    data = make_synthetic(steps * batch, opts["in_features"], 4, seed=1234)
    g = torch.Generator().manual_seed(0)
    loader = DataLoader(data, batch_size=batch, shuffle=True, generator=g, drop_last=True)
    records, loss_sum, wall, cpu = [], torch.zeros(()), 0.0, 0.0
    for step, (x, y) in enumerate(loader, start=1):
        if step == 2:  # the first step infers shapes and builds buffers: not counted
            busy[:] = [0.0, 0.0]
        losses: list[torch.Tensor] = []
        started, cpu0 = time.perf_counter(), time.thread_time()
        schedule.step(*((x,) if 0 in local else ()), target=y, losses=losses, return_outputs=False)
        if step >= 2:
            wall += time.perf_counter() - started
            cpu += time.thread_time() - cpu0
        grads = [p.grad for p in params if p.grad is not None]
        sq = torch.stack([torch.linalg.vector_norm(gr) for gr in grads]).square().sum()
        dist.all_reduce(sq)  # the global norm over all stages, as disttrain's clipping
        torch._foreach_mul_(grads, torch.clamp(1.0 / (sq.sqrt() + 1e-6), max=1.0))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if losses:
            loss_sum += torch.stack(losses).detach().sum()
        if step % opts["log_every"] == 0 or step == steps:
            dist.all_reduce(loss_sum)  # only the last stage holds a loss
            records.append({"step": step, "time": time.time(), "loss": loss_sum.item() / opts["log_every"]})
            loss_sum = torch.zeros(())
        if step == steps:
            break
    # gloo's point-to-point latency: half a ping-pong of one micro-batch's activation
    act, rtts = torch.randn(batch // m, width), []
    dist.barrier()
    for _ in range(30):
        started = time.perf_counter()
        if rank == 0:
            dist.send(act, 1)
            dist.recv(act, 1)
        else:
            dist.recv(act, 0)
            dist.send(act, 0)
        rtts.append(time.perf_counter() - started)
    timed_steps, actions = steps - 1, 2 * v * m  # a forward and a backward per micro-batch and stage
    mine = {
        "idle": 1.0 - busy[0] / wall,
        "mb_ms": 1000 * busy[0] / timed_steps / m,
        "cpu_per_action_ms": 1000 * (cpu - busy[1]) / timed_steps / actions,
        "p2p_ms": 1000 * statistics.median(rtts) / 2,
        "state": state_bytes(params, optimizer),
    }
    by_rank: list[Any] = [None] * world
    dist.all_gather_object(by_rank, mine)
    if rank == 0:
        result = result_row(records, opts["warmup"], "loss", max(r["state"] for r in by_rank))
        result.update(
            extra={
                "idle meas.": statistics.mean(r["idle"] for r in by_rank),
                "idle theory": (world - 1) / (v * m + world - 1),
                "mb ms": max(r["mb_ms"] for r in by_rank),
                "p2p ms": statistics.mean(r["p2p_ms"] for r in by_rank),
                "sched CPU/action ms": statistics.mean(r["cpu_per_action_ms"] for r in by_rank),
            }
        )
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def _median(row: Row, key: str) -> float | None:
    values = [x["extra"][key] for x in row.results if key in x.get("extra", {})]
    return statistics.median(values) if values else None


def table(rows: list[Row]) -> str:
    by_name = {r.name: r for r in rows}
    extra_cols = list(dict.fromkeys(k for r in rows for x in r.results for k in x.get("extra", {})))
    head = [
        "strategy",
        "ranks",
        "step ms",
        "vs ddp",
        "state B/rank",
        "vs ddp",
        "allreduce B/step",
        *extra_cols,
    ]
    lines = []
    for r in rows:
        ms = statistics.median(x["step_ms"] for x in r.results)
        res = r.results[0]
        base = by_name.get(r.baseline, by_name["ddp"])
        base_ms = statistics.median(x["step_ms"] for x in base.results)
        base_bytes = base.results[0]["state_bytes"]
        ar = res["allreduce_per_step"]
        cells = [
            r.name,
            str(r.world),
            f"{ms:.2f}",
            f"{ms / base_ms:.2f}x",
            f"{res['state_bytes']:,}",
            f"{res['state_bytes'] / base_bytes:.2f}",
            "-" if ar is None else f"{ar:,.0f}",
            *("-" if (e := _median(r, k)) is None else f"{e:.2f}" for k in extra_cols),
        ]
        lines.append(cells + ([r.note] if r.note else []))
    widths = [max(len(str(c[i])) for c in [head, *lines] if i < len(c)) for i in range(len(head))]
    fmt = [
        " | ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=False)) for cells in [head, *lines]
    ]
    notes = [f"   {cells[-1]}" if len(cells) > len(head) else "" for cells in [head, *lines]]
    rule = "-+-".join("-" * w for w in widths)
    out = [fmt[0], rule] + [f + n for f, n in zip(fmt[1:], notes[1:], strict=True)]
    return "\n".join(out)


def verdicts(rows: list[Row]) -> list[str]:
    """One line per target of issue 16 that this run measured: PASS/FAIL and the numbers."""
    by = {r.name: r for r in rows if r.results}

    def ms(name: str) -> float:
        return statistics.median(x["step_ms"] for x in by[name].results)

    def mark(ok: bool) -> str:
        return "PASS" if ok else "FAIL"

    out = []
    for sched, m in PIPE_SCHEDULES:
        for name in (pipe_name(sched, m), pipe_name(sched, m, bare=True)):
            if name not in by:
                continue
            idle, theory, mb = (_median(by[name], k) or 0.0 for k in ("idle meas.", "idle theory", "mb ms"))
            gap = idle - theory
            line = f"{mark(abs(gap) <= 0.05)}  {name}: idle {idle:.2f} vs theory {theory:.2f} (+{gap:.2f}; target 0.05)"
            if mb < MIN_MB_MS:
                line += f" - a micro-batch computes {mb:.1f} ms < {MIN_MB_MS:.0f} ms: outside the target's premise"
            out.append(line)
        ours, bare = pipe_name(sched, m), pipe_name(sched, m, bare=True)
        if ours in by and bare in by:
            out.append(
                f"info  {ours}: disttrain / bare pipelining step time {ms(ours) / ms(bare):.2f}x, "
                f"idle {_median(by[ours], 'idle meas.'):.2f} vs {_median(by[bare], 'idle meas.'):.2f}"
            )
    for m in sorted({m for _, m in PIPE_SCHEDULES}):
        for bare in (False, True):
            inter, flat = pipe_name("interleaved_1f1b", m, bare), pipe_name("1f1b", m, bare)
            if inter in by and flat in by:
                out.append(
                    f"{mark(ms(inter) < ms(flat))}  interleaved beats 1f1b at m={m}{' (bare)' if bare else ''}: "
                    f"{ms(inter):.1f} vs {ms(flat):.1f} ms/step ({ms(inter) / ms(flat):.2f}x)"
                )
    ddp = "ddp (pp model)"
    for name, bare, limit in (
        ("hsdp (2,1) (pp model)", "bare HSDP (2,1) (pp model)", 1.2),
        ("fsdp (pp model)", "bare fully_shard (pp model)", 2.0),
    ):
        if name not in by or ddp not in by:
            continue
        ratio = ms(name) / ms(ddp)
        line = f"{name}: {ratio:.2f}x ddp (target {limit}x)"
        ok = ratio <= limit
        if bare in by:
            to_bare, bare_ratio = ms(name) / ms(bare), ms(bare) / ms(ddp)
            line += f"; bare FSDP2 {bare_ratio:.2f}x ddp, disttrain / bare {to_bare:.2f}x (target 1.05x)"
            ok = ok or (bare_ratio > limit and to_bare <= 1.05)
        out.append(f"{mark(ok)}  {line}")
    return out


def _load() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--bare-worker":
        bare_worker(json.loads(sys.argv[2]), sys.argv[3])
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--warmup", type=int, default=20, help="first step that counts towards step time")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--width", type=int, default=256, help="input and hidden width of the MLP")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--only", nargs="*", help="row names to run (ddp always runs)")
    p.add_argument("--quick", action="store_true", help="--steps 40 --warmup 10 --repeats 1")
    args = p.parse_args()
    if args.quick:
        args.steps, args.warmup, args.repeats = 40, 10, 1
    wanted = {name for r in ROWS if not args.only or r.name in args.only for name in (r.name, r.baseline)}
    rows = [r for r in ROWS if r.name in wanted or r.name == "ddp"]
    load_before = _load()
    with tempfile.TemporaryDirectory(prefix="bench_strategies_") as tmp:
        for rep in range(args.repeats):
            for row in rows if rep % 2 == 0 else rows[::-1]:
                row.results.append(run(row, args, Path(tmp)))
                res = row.results[-1]
                extra = "".join(f", {k} {v:.2f}" for k, v in res.get("extra", {}).items())
                print(f"  {row.name}: {res['step_ms']:.2f} ms/step{extra}", file=sys.stderr, flush=True)
    print(
        f"{WORLD} gloo ranks (CPU, 1 thread each), MLP width {args.width} x3, batch {BATCH}/rank, "
        f"{args.steps} steps, median of {args.repeats}"
    )
    print(table(rows))
    print(f"load average (1, 5, 15 min) before: {load_before}, after: {_load()} on {os.cpu_count()} cores")
    print("\n".join(verdicts(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
