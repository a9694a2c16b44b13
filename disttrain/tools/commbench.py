"""Per-rank side of `disttrain bench comm`: every op at every size, checked once, then timed.

Launched like training (torchrun, spawn, or in-process) with this module as the rank entry:
`python -m disttrain.tools.commbench RUN_DIR` reads RUN_DIR/config.yaml and RUN_DIR/commbench.json;
rank 0 writes RUN_DIR/results.json, which the parent prints.

Per op and size: one iteration with known inputs whose result every rank checks, `warmup`
iterations, then `iters` iterations timed as one loop (a bare `for` over the op; no per-iteration
work). A wrong result is reported with op, size, rank and the first wrong element; a collective that
fails or times out (backend.timeout) raises naming op, size and rank.

Test hook: DISTTRAIN_COMMBENCH_FAULT=wrong:OP:RANK corrupts RANK's checked result of OP (to prove the
check catches it); hang:OP:RANK makes RANK stall before OP (to prove a timeout names it).
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from disttrain.config.run import Run
from disttrain.dist import DistEnv, destroy_process_group, init_process_group
from disttrain.observe.log import get_logger, setup_logging, teardown_logging
from disttrain.rundir import RunDir, read_config, write_json
from disttrain.tools.collectives import DTYPES, bus_factor, make_case

SPEC = "commbench.json"
RESULTS = "results.json"
SCHEMA = "disttrain.bench.comm/1"
FAULT_VAR = "DISTTRAIN_COMMBENCH_FAULT"
UNSUPPORTED = re.compile(r"not supported|unsupported|not implemented", re.IGNORECASE)

log = get_logger()


class CommBenchError(RuntimeError):
    """A collective failed or timed out; the message names op, size and rank."""


def sizes(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    """min, min x factor, ... up to max (max itself always included)."""
    out, s = [], max(1, min_bytes)
    while s < max_bytes:
        out.append(s)
        s *= max(2, factor)
    out.append(max(max_bytes, 1))
    return sorted(set(out))


def iterations(nbytes: int, iters: int, budget_bytes: int) -> int:
    """`iters`, fewer for big buffers so one size moves about `budget_bytes` (at least 3)."""
    if nbytes <= 0:
        return iters
    return max(3, min(iters, math.ceil(budget_bytes / nbytes)))


def time_loop(run: Any, iters: int, device: torch.device) -> float:
    """Seconds per iteration of `run` over `iters` back-to-back calls (the bare timing loop)."""
    dist.barrier()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        run()
    sync()
    return (time.perf_counter() - start) / iters


def _fault(op: str, rank: int) -> str | None:
    kind, _, target = os.environ.get(FAULT_VAR, "").partition(":")
    fop, _, frank = target.partition(":")
    return kind if fop == op and frank == str(rank) else None


def measure(env: DistEnv, op: str, nbytes: int, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Check then time `op` at `nbytes` on this rank: a row (this rank's time, its check)."""
    case = make_case(op, nbytes, env.rank, env.world_size, DTYPES[spec["dtype"]], env.device)
    row: dict[str, Any] = {"op": op, "bytes": case.nbytes, "status": "ok", "wrong": None}
    fault = _fault(op, env.rank)
    started = time.perf_counter()
    try:
        case.fill()
        if fault == "hang":
            time.sleep(timeout + 60)
        case.run()
        if fault == "wrong" and case.result is not None:
            case.result.view(-1)[0] += 1
        row["wrong"] = case.check()
        iters = iterations(case.nbytes, spec["iters"], spec["budget_bytes"])
        if spec["warmup"]:
            time_loop(case.run, spec["warmup"], env.device)
        row.update(iters=iters, time_s=time_loop(case.run, iters, env.device))
    except (RuntimeError, NotImplementedError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if UNSUPPORTED.search(first):  # raised locally by the backend, before any data moved
            row.update(status=f"unsupported: {first}", iters=0, time_s=None)
            return row
        raise CommBenchError(
            f"{op} of {case.nbytes} B failed on rank {env.rank} of {env.world_size} after "
            f"{time.perf_counter() - started:.1f} s (backend.timeout={timeout:g} s): {first}"
        ) from exc
    return row


def bench(env: DistEnv, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Every op x size on this rank; rank 0 returns the merged report (others: their rows)."""
    started = time.perf_counter()
    rows = []
    for op in spec["ops"]:
        for nbytes in [0] if op == "barrier" else spec["sizes"]:
            if op == "send_recv" and env.world_size < 2:
                rows.append({"op": op, "bytes": nbytes, "status": "skipped: needs 2+ ranks", "time_s": None})
                continue
            rows.append(measure(env, op, nbytes, spec, timeout))
            log.info("%s %s B: %s", op, rows[-1]["bytes"], rows[-1]["status"])
    times = [r["time_s"] if r["time_s"] is not None else math.nan for r in rows]
    wrong = [(i, r["wrong"]) for i, r in enumerate(rows) if r.get("wrong")]
    every: list[Any] = [(times, wrong)]
    if env.world_size > 1:  # one exchange at the end: nothing extra inside the timed loops
        # An object collective: torch moves the bytes on the group's device (NCCL: the bound GPU).
        # A tensor built here would be a CPU tensor, which an NCCL group refuses.
        every = [None] * env.world_size
        dist.all_gather_object(every, (times, wrong))
    every_time = torch.tensor([t for t, _ in every], dtype=torch.float64)
    every_wrong = [w for _, w in every]
    return _merge(env, spec, rows, every_time, every_wrong, time.perf_counter() - started)


def _merge(
    env: DistEnv,
    spec: dict[str, Any],
    rows: list[dict[str, Any]],
    times: torch.Tensor,
    wrong: list[Any],
    wall: float,
) -> dict[str, Any]:
    n = env.world_size
    results, errors = [], []
    for i, r in enumerate(rows):
        row = {k: r[k] for k in ("op", "bytes", "status")}
        row["iters"] = r.get("iters", 0)
        bad = [(rank, msg) for rank, items in enumerate(wrong) for j, msg in items if j == i]
        for rank, msg in bad:
            errors.append({"op": r["op"], "bytes": r["bytes"], "rank": rank, "error": f"wrong result: {msg}"})
        row["correct"] = None if r["status"] != "ok" else not bad
        col = times[:, i]
        if r["status"] == "ok" and not torch.isnan(col).any():
            t = float(col.mean())
            factor = bus_factor(r["op"], n)
            algbw = r["bytes"] / t / 1e9 if factor is not None and t > 0 else None
            row.update(
                time_us=t * 1e6,
                time_us_min=float(col.min()) * 1e6,
                time_us_max=float(col.max()) * 1e6,
                algbw_gbps=algbw,
                busbw_gbps=algbw * factor if algbw is not None and factor is not None else None,
                bus_factor=factor,
            )
        results.append(row)
    return {
        "schema": SCHEMA,
        "backend": env.backend,
        "world_size": n,
        "device": str(env.device),
        "dtype": spec["dtype"],
        "torch": torch.__version__,
        "time": "mean over ranks of each rank's average iteration time (nccl-tests' default)",
        "units": {
            "time_us": "microseconds",
            "algbw_gbps": "GB/s (1e9 bytes)",
            "busbw_gbps": "GB/s (1e9 bytes)",
        },
        "results": results,
        "errors": errors,
        "wall_s": round(wall, 3),
    }


def run(run_dir: str | Path) -> dict[str, Any] | None:
    """Rank entry (the launcher's `entry`): bench as the rank the environment describes."""
    run_dir = Path(run_dir)
    run_ = Run.of(read_config(run_dir))
    spec = json.loads((run_dir / SPEC).read_text())
    env = DistEnv.from_env(str(run_.backend.name))
    setup_logging(RunDir(run_dir).logs, env.rank, to_console=False)
    from disttrain.launch import threads_per_rank

    torch.set_num_threads(threads_per_rank(run_))
    try:
        report = run_in_group(env, run_, spec)
        if env.is_zero:
            write_json(run_dir / RESULTS, report)
        return report
    except BaseException:
        log.exception("rank %d failed", env.rank)
        raise
    finally:
        teardown_logging()


def run_in_group(env: DistEnv, run: Run, spec: dict[str, Any]) -> dict[str, Any]:
    """Join the group, bench, leave it (used by launched ranks and by ranks started by someone else)."""
    timeout = float(run.backend.timeout)
    try:
        init_process_group(env, timeout)
        return bench(env, spec, timeout)
    finally:
        destroy_process_group()


if __name__ == "__main__":
    from disttrain.dist import rank_main

    raise SystemExit(rank_main(run, "disttrain.tools.commbench"))
