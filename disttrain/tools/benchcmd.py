"""`disttrain bench comm`: compose + check the config once, launch ranks like `train`, print rank 0's report.

disttrain bench comm nproc_per_node=2 backend=gloo            # table
disttrain bench comm --json --ops all_reduce,all_gather --max-bytes 256M
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from disttrain.config.run import Run

# Default sweep: bytes to a few MiB on CPU (a short run: ~10 s of collectives on 2 gloo ranks),
# bytes to hundreds of MiB with GPUs, as nccl-tests' usual `-b 8 -e 256M`.
CPU_MAX, GPU_MAX = 4 << 20, 256 << 20
CPU_BUDGET, GPU_BUDGET = 32 << 20, 8 << 30


def parser() -> argparse.ArgumentParser:
    from disttrain.tools.collectives import DTYPES, OPS

    p = argparse.ArgumentParser(
        prog="disttrain bench comm",
        description="Collective benchmark and smoke test (nccl-tests' algbw/busbw) over the configured "
        "backend and launcher. Trailing key=value arguments are config overrides, as for `train`.",
    )
    p.add_argument("what", choices=["comm"], help="what to benchmark")
    p.add_argument("--json", action="store_true", help="print rank 0's report as JSON")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma list from: {', '.join(OPS)}")
    p.add_argument("--min-bytes", default="8", help="smallest buffer S (K/M/G suffixes)")
    p.add_argument(
        "--max-bytes",
        default=None,
        help=f"largest S (default {CPU_MAX >> 20}M on CPU, {GPU_MAX >> 20}M on GPU)",
    )
    p.add_argument("--factor", type=int, default=4, help="size multiplier between steps (>= 2)")
    p.add_argument("--iters", type=int, default=20, help="timed iterations per op and size")
    p.add_argument("--warmup", type=int, default=3, help="untimed iterations before timing")
    p.add_argument(
        "--budget", default=None, help="fewer iterations for big buffers: ~this many bytes per size"
    )
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument(
        "--timeout", type=float, default=None, help="seconds before a collective fails (backend.timeout)"
    )
    p.add_argument("--out", default=None, help="keep the bench dir here (default: a temporary dir, removed)")
    p.add_argument("--config-dir", default=None, help="your own config folder, as for train")
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. nproc_per_node=2 backend=gloo")
    return p


def make_spec(args: argparse.Namespace, on_gpu: bool) -> dict[str, Any]:
    from disttrain.config.errors import ConfigError
    from disttrain.tools.collectives import OPS
    from disttrain.tools.commbench import sizes
    from disttrain.tools.render import parse_bytes

    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    unknown = [o for o in ops if o not in OPS]
    if unknown or not ops:
        raise ConfigError(
            "--ops", args.ops, "a comma list of " + ", ".join(OPS), "e.g. --ops all_reduce,all_gather."
        )
    try:
        low = parse_bytes(args.min_bytes)
        high = parse_bytes(args.max_bytes) if args.max_bytes else (GPU_MAX if on_gpu else CPU_MAX)
        budget = parse_bytes(args.budget) if args.budget else (GPU_BUDGET if on_gpu else CPU_BUDGET)
    except ValueError as exc:
        raise ConfigError(
            "--min-bytes/--max-bytes/--budget", "?", "sizes like 8, 64K, 4M, 1G", str(exc)
        ) from None
    if high < low:
        raise ConfigError("--max-bytes", args.max_bytes, f">= --min-bytes ({low})", "swap the two values.")
    if args.factor < 2 or args.iters < 1 or args.warmup < 0:
        raise ConfigError(
            "--factor/--iters/--warmup",
            f"{args.factor}/{args.iters}/{args.warmup}",
            "factor >= 2, iters >= 1, warmup >= 0",
            "the defaults are --factor 4 --iters 20 --warmup 3.",
        )
    return {
        "ops": ops,
        "sizes": sizes(low, high, args.factor),
        "iters": args.iters,
        "warmup": args.warmup,
        "budget_bytes": budget,
        "dtype": args.dtype,
    }


def compose_checked(args: argparse.Namespace) -> Run:
    """The same composition and static checks as `train`, plus the GPU checks the backend needs."""
    from disttrain.config import compose, resolve
    from disttrain.config.run import Run
    from disttrain.preflight.checks import check_static
    from disttrain.preflight.gpus import check_nccl_ranks

    run = Run.of(resolve(compose(args.overrides, args.config_dir), args.overrides))
    if args.timeout is not None:
        run = run.updated({"backend": {"timeout": args.timeout}})
    check_static(run)
    check_nccl_ranks(run)
    return run


def cmd_bench(rest: list[str]) -> int:
    args = parser().parse_intermixed_args(rest)
    run = compose_checked(args)
    from disttrain.config.gpus import choose_backend
    from disttrain.launch import launched_externally

    spec = make_spec(args, on_gpu=choose_backend(run.backend.name) == "nccl")
    if launched_externally():
        return _as_launched_rank(args, run, spec)
    from disttrain.launch import LaunchError, launch
    from disttrain.rundir import command_line, freeze, write_json
    from disttrain.tools.commbench import RESULTS, SPEC

    out = Path(args.out).resolve() if args.out else Path(tempfile.mkdtemp(prefix="disttrain-bench-"))
    freeze(out, run, args.overrides, command_line())
    write_json(out / SPEC, spec)
    try:
        launch(run, out, entry="disttrain.tools.commbench")
    except LaunchError as exc:
        sys.stderr.write(f"disttrain: bench {exc}\n")
        return 1
    if not (out / RESULTS).is_file():  # another node's agent: rank 0 lives on node 0
        sys.stdout.write(f"node {run.world.node_rank} done; the report is printed on node 0\n")
        return 0
    report = json.loads((out / RESULTS).read_text())
    if not args.out:
        shutil.rmtree(out, ignore_errors=True)
    return show(report, args.json)


def _as_launched_rank(args: argparse.Namespace, run: Run, spec: dict[str, Any]) -> int:
    """Inside ranks someone else started (`torchrun -m disttrain bench comm`): bench here, rank 0 prints."""
    import torch

    from disttrain.dist import DistEnv
    from disttrain.launch import threads_per_rank
    from disttrain.tools.commbench import run_in_group

    env = DistEnv.from_env(str(run.backend.name))
    torch.set_num_threads(threads_per_rank(run))
    report = run_in_group(env, run, spec)
    return show(report, args.json) if env.is_zero else 0


def show(report: dict[str, Any], as_json: bool) -> int:
    """Print the report; exit 1 when any result was wrong (each named by op, size and rank)."""
    if as_json:
        from disttrain.tools.render import print_json

        print_json(report)
    else:
        render(report)
    for e in report["errors"]:
        sys.stderr.write(
            f"disttrain: bench comm: {e['op']} of {e['bytes']} B on rank {e['rank']}: {e['error']}\n"
        )
    return 1 if report["errors"] else 0


def _num(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def render(report: dict[str, Any]) -> None:
    from disttrain.tools.render import console, human_bytes, table

    rows, last = [], None
    for r in report["results"]:
        check = "ok" if r["correct"] else "WRONG" if r["correct"] is False else r["status"]
        rows.append(
            (
                r["op"] if r["op"] != last else "",
                human_bytes(r["bytes"]) if r["op"] != "barrier" else "-",
                r["iters"],
                _num(r.get("time_us"), ".1f"),
                _num(r.get("algbw_gbps"), ".3f"),
                _num(r.get("busbw_gbps"), ".3f"),
                check,
            )
        )
        last = r["op"]
    title = (
        f"bench comm: {report['backend']}, {report['world_size']} ranks, {report['device']}, {report['dtype']} "
        f"({report['wall_s']:.1f} s)"
    )
    out = console()
    out.print(
        table(title, ["op", ">size", ">iters", ">time us", ">algbw GB/s", ">busbw GB/s", "check"], rows)
    )
    out.print(
        "time: mean over ranks of the average iteration; algbw = size / time; busbw = algbw x "
        "2(n-1)/n (all_reduce), (n-1)/n (all_gather, reduce_scatter, all_to_all, gather, scatter), "
        "1 (broadcast, reduce, send_recv) - nccl-tests' definitions."
    )
