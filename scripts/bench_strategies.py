"""Strategies side by side on 2 gloo ranks: steady-state step time relative to ddp, per-rank state.

Every row is a real `disttrain train` run (the CLI, torchrun, the engine) on the same model, data,
global batch and steps; the numbers come from its metrics.jsonl and summary.json:

- step ms: steady state, (time of the last log - time of the first log at or after `--warmup`) /
  steps in between, median over `--repeats` (rows interleave across repeats);
- state bytes: parameters + gradients + optimizer state held by the fullest rank (local shards);
- allreduce bytes/step: for strategies that count them (localsgd).

Rows named `bare ...` are not disttrain: a plain torchrun script (this file, `--bare-worker`) that
calls `fully_shard` itself on the same model (every Linear a unit, then the root, as
`strategy.wrap_classes=[Linear]`), data, AdamW, clipping and log cadence, so the FSDP and HSDP rows
can be read against what FSDP2 itself costs on this backend, not only against ddp.

Rows are a list: a strategy (or a variant) is one `Row`; a row may add its own columns with
`extra` (e.g. a pipeline's bubble fraction), printed after the shared ones.

    python scripts/bench_strategies.py               # ~3-4 min on 2 cores
    python scripts/bench_strategies.py --quick       # fewer steps, one repeat
"""

from __future__ import annotations

import argparse
import json
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
    bare: str | None = None  # a plain fully_shard script instead of disttrain: "fsdp" or "hsdp"
    results: list[dict[str, Any]] = field(default_factory=list)


def one_process(*overrides: str) -> tuple[str, ...]:
    return ("nproc_per_node=1", f"trainer.batch_size={WORLD * BATCH}", *overrides)


# ---------------------------------------------------------------------------------- model parallel
# Pipeline and tp ranks split ONE model and read the same data: their batch is the global 2B. The
# pipeline rows train a wider MLP with 4 hidden layers on a larger batch, so that compute, not the
# schedule's per-action overhead, fills a micro-batch, and so that the 2 stages (and the 4 interleaved
# ones, cut by split_points at one Linear each) hold equal compute: the measured bubble is then
# comparable with the theory, which assumes equal stages. "ddp (pp model)" is their baseline.
PP_WIDTH, PP_BATCH = 1024, 256  # global batch of the pipeline rows
PP_MODEL = (f"data.num_features={PP_WIDTH}", f"model.hidden=[{','.join([str(PP_WIDTH)] * 4)}]")
PP_SPLIT4 = "strategy.split_points=[layers.3,layers.5,layers.7]"
FSDP_PP = ("strategy=fsdp", "strategy.wrap_classes=[Linear]", f"trainer.batch_size={PP_BATCH // WORLD}")


def bubble(run_dir: Path) -> dict[str, str]:
    """Measured idle fraction (1 - compute time / schedule time, mean over ranks) and the theory."""
    stats = json.loads((run_dir / "summary.json").read_text())["pipeline"]
    return {"idle meas.": f"{stats['idle_fraction']:.2f}", "idle theory": f"{stats['bubble_theory']:.2f}"}


def pipeline_row(schedule: str, m: int, *extra: str) -> Row:
    v = 2 if schedule == "interleaved_1f1b" else 1
    overrides = (
        *PP_MODEL,
        "strategy=pipeline",
        f"strategy.schedule={schedule}",
        f"strategy.n_microbatches={m}",
        f"strategy.stages_per_rank={v}",
        f"trainer.batch_size={PP_BATCH}",
        *extra,
    )
    name = f"pipeline {schedule} m={m}" + (f" v={v}" if v > 1 else "")
    return Row(name, overrides, extra=bubble, baseline="ddp (pp model)", note="same data on both ranks")


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
            note=f"baseline of the pipeline rows: MLP {PP_WIDTH} x4, global batch {PP_BATCH}",
        ),
        Row("fsdp (pp model)", (*PP_MODEL, *FSDP_PP), baseline="ddp (pp model)"),
        Row("bare fully_shard (pp model)", PP_MODEL, baseline="ddp (pp model)", bare="fsdp"),
        Row(
            "hsdp (2,1) (pp model)", (*PP_MODEL, *FSDP_PP, "strategy.replicate=2"), baseline="ddp (pp model)"
        ),
        Row("bare HSDP (2,1) (pp model)", PP_MODEL, baseline="ddp (pp model)", bare="hsdp"),
        pipeline_row("gpipe", 4),
        pipeline_row("1f1b", 4),
        pipeline_row("1f1b", 8),
        pipeline_row("interleaved_1f1b", 4, PP_SPLIT4),
        pipeline_row("interleaved_1f1b", 8, PP_SPLIT4),
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


def run(row: Row, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix=row.name.split()[0] + "_", dir=root))
    if row.bare is not None:
        return run_bare(row, args, folder)
    cmd = [
        shutil.which("disttrain") or "disttrain",
        "train",
        "data=synthetic",
        "data.val=null",
        f"data.num_features={args.width}",
        f"model.hidden=[{args.width},{args.width},{args.width}]",
        "sched=constant",
        f"trainer.max_steps={args.steps}",
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
    timed = [r for r in records if "train/loss" in r and r["step"] >= args.warmup]
    first, last = timed[0], timed[-1]
    summary = json.loads((run_dir / "summary.json").read_text())
    out = {
        "step_ms": 1000 * (last["time"] - first["time"]) / max(last["step"] - first["step"], 1),
        "state_bytes": max(summary["state_bytes_by_rank"]),
        "allreduce_per_step": summary.get("allreduce_bytes_per_step"),
        "final_loss": last["train/loss"],
    }
    if row.extra is not None:
        out["extra"] = row.extra(run_dir)
    shutil.rmtree(folder, ignore_errors=True)
    return out


def run_bare(row: Row, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """The same model through a plain torchrun + fully_shard script (see the module docstring)."""
    opts = {**vars(args), "kind": row.bare, "width": PP_WIDTH, "layers": 4, "batch": PP_BATCH // WORLD}
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


def _one_thread() -> dict[str, str]:
    import os

    return {**os.environ, "OMP_NUM_THREADS": "1"}


def bare_worker(opts: dict[str, Any], out: str) -> None:
    """One rank of the plain FSDP2 loop: disttrain's MLP and synthetic data, nothing of its engine."""
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

    def local(t: torch.Tensor) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    params = list(model.parameters())
    mine = 2 * sum(local(p) for p in params) + sum(
        local(v) for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v)
    )
    by_rank: list[Any] = [None] * world
    dist.all_gather_object(by_rank, mine)
    if rank == 0:
        timed = [r for r in records if r["step"] >= opts["warmup"]]
        first, last = timed[0], timed[-1]
        result = {
            "step_ms": 1000 * (last["time"] - first["time"]) / max(last["step"] - first["step"], 1),
            "state_bytes": max(by_rank),
            "allreduce_per_step": None,
            "final_loss": last["loss"],
        }
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def table(rows: list[Row]) -> str:
    by_name = {r.name: r for r in rows}
    extra_cols = sorted({k for r in rows for x in r.results for k in x.get("extra", {})})
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
            *(res.get("extra", {}).get(k, "-") for k in extra_cols),
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
    with tempfile.TemporaryDirectory(prefix="bench_strategies_") as tmp:
        for rep in range(args.repeats):
            for row in rows if rep % 2 == 0 else rows[::-1]:
                row.results.append(run(row, args, Path(tmp)))
                print(f"  {row.name}: {row.results[-1]['step_ms']:.2f} ms/step", file=sys.stderr, flush=True)
    print(
        f"{WORLD} gloo ranks (CPU, 1 thread each), MLP width {args.width} x3, batch {BATCH}/rank, "
        f"{args.steps} steps, median of {args.repeats}"
    )
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
