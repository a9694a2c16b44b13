"""Where the time from `disttrain train` to the first training step goes, against bare torchrun.

Three commands, run interleaved (rotated order per repeat), each timed from the moment this script
starts it to the end of rank 0's first optimizer step:

- bare: `python -m torch.distributed.run --standalone --nproc_per_node 2 THIS --worker`: each rank
  imports torch, loads the digits, builds the same MLP (nn.Sequential), DDP over gloo, AdamW, and
  takes a step. This is the floor every launcher pays (torchrun's import of torch, the ranks'
  imports, the process group).
- default: `disttrain train` with the default job (MLP on the digits, 2 ranks, DDP, gloo), stopped
  after a few steps (trainer.max_steps).
- user: the same with a user `_target_` model from the cwd (`model._target_=mylab.nets.Net`).

Every process appends `time.time() pid rank phase` lines to a file named by DISTTRAIN_TIMING
(disttrain/timing.py): the CLI (cli, compose_start/end, static_checks, runtime_checks_start,
runtime_imports, dry_step_start, runtime_checks, run_dir, hydra_task, frozen, launch ...), every rank
(rank_start, rank_imported, process_group, built) and the first step (summary.json first_step_at;
the bare rank marks first_step itself). The table is the median offset of each phase from exec
over the repeats; "compose x N" counts Hydra compositions per run.

    python scripts/bench_first_step.py               # 5 repeats, ~2-3 min on a quiet 2-core machine
    python scripts/bench_first_step.py --repeats 9
    python scripts/bench_first_step.py --base-tree ../main   # + default@base, user@base: another
                                                     # checkout's disttrain, interleaved (before/after)

A base tree without disttrain/timing.py marks nothing: only its first step is shown.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TIMING = "DISTTRAIN_TIMING"
TARGET_S = 0.3  # the target: at most this much later than bare torchrun
KINDS = ("bare", "default", "user", "default@base", "user@base")

NETS = """\
from torch import nn


class Net(nn.Module):
    def __init__(self, in_features: int, num_classes: int, width: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(in_features, width), nn.ReLU(), nn.Linear(width, num_classes))

    def forward(self, x):
        return self.body(x)
"""


# ------------------------------------------------------------------------------------ bare rank
def _mark(phase: str, at: float | None = None) -> None:
    path = os.environ[TIMING]
    with open(path, "a", encoding="utf-8") as f:
        cpu = 0.0 if at is not None else time.process_time()
        f.write(
            f"{time.time() if at is None else at:.6f} {os.getpid()} {os.environ.get('RANK', '-')} {phase} {cpu:.4f}\n"
        )


def _process_start() -> float:
    """When this process started (as disttrain.timing.mark_process_start, without importing disttrain)."""
    with open(f"/proc/{os.getpid()}/stat", encoding="ascii") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime", encoding="ascii") as f:
        uptime = float(f.read().split()[0])
    return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")


def _bare_rank(steps: int) -> None:
    """One rank of the bare loop: what any torchrun script does before its first step."""
    _mark("rank_start", _process_start())
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    _mark("rank_imported")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    _mark("process_group")
    rank, world = dist.get_rank(), dist.get_world_size()
    digits = Path(__file__).resolve().parent.parent / "disttrain" / "data" / "digits.npz"
    with np.load(digits) as f:
        x = torch.from_numpy(f["images"].astype(np.float32) / 16.0)
        y = torch.from_numpy(f["labels"].astype(np.int64))
    data = TensorDataset(x, y)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10)
    )
    model = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sampler = DistributedSampler(data, world, rank, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(data, batch_size=32, sampler=sampler, drop_last=True)
    _mark("built")
    for step, (xb, yb) in enumerate(loader, start=1):
        F.cross_entropy(model(xb), yb).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step == 1:
            _mark("first_step")
        if step == steps:
            break
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------ parent side
def command(kind: str, steps: int) -> list[str]:
    if kind == "bare":
        return [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            os.path.abspath(__file__), "--worker", "--steps", str(steps),
        ]  # fmt: skip
    cmd = [
        sys.executable,
        "-m",
        "disttrain",
        "train",
        f"trainer.max_steps={steps}",
        "checkpoint.export_final=false",
    ]
    if kind == "user":
        cmd += [
            "model._target_=mylab.nets.Net",
            "model.in_features=${data.num_features}",
            "model.num_classes=${data.num_classes}",
            "model.width=128",
        ]
    return cmd


def read_marks(path: Path, parent: int) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Phase -> times: the parent's marks and rank 0's (a phase marked twice keeps every time);
    and phase -> CPU seconds the marking process had used by then (first mark of each phase)."""
    marks: dict[str, list[float]] = {}
    cpu: dict[str, float] = {}
    if not path.is_file():
        return marks, cpu
    for line in path.read_text(encoding="utf-8").splitlines():
        t, pid, rank, phase, *used = line.split()
        if int(pid) == parent or rank == "0":
            marks.setdefault(phase, []).append(float(t))
            if used:
                cpu.setdefault(phase, float(used[0]))
    return marks, cpu


def run_once(kind: str, work: Path, tag: str, steps: int, base_tree: str | None = None) -> dict[str, Any]:
    cwd = work / f"{kind}_{tag}"
    cwd.mkdir()
    kind, _, at = kind.partition("@")
    if kind == "user":
        (cwd / "mylab").mkdir()
        (cwd / "mylab" / "__init__.py").write_text("")
        (cwd / "mylab" / "nets.py").write_text(NETS)
    timing = cwd / "timing.txt"
    env = {**os.environ, TIMING: str(timing)}
    env.pop("OMP_NUM_THREADS", None)
    if at and base_tree:
        env["PYTHONPATH"] = os.path.abspath(base_tree)
    launched = time.time()
    proc = subprocess.Popen(
        command(kind, steps), cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    _, err = proc.communicate(timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} exited {proc.returncode}: {err.decode(errors='replace')[-2000:]}")
    marks, cpu = read_marks(timing, proc.pid)
    if kind != "bare":
        summaries = list(cwd.glob("runs/*/*/summary.json"))
        marks["first_step"] = [json.loads(summaries[0].read_text())["first_step_at"]]
    result = {phase: ts[0] - launched for phase, ts in marks.items()}
    result["compose_count"] = len(marks.get("compose_start", []))
    if "launch" in cpu:
        result["parent_cpu_to_launch"] = cpu["launch"]
    if "built" in cpu:
        result["rank0_cpu_to_built"] = cpu["built"]
    return result


PHASES = [
    ("cli", "parent: interpreter + disttrain.cli imported"),
    ("compose_end", "parent: first compose done"),
    ("static_checks", "parent: static checks"),
    ("runtime_imports", "parent: torch + builders imported"),
    ("dry_step_start", "parent: runtime checks (data, meta model, optim)"),
    ("runtime_checks", "parent: dry step"),
    ("run_dir", "parent: run dir claimed (compose again)"),
    ("hydra_task", "parent: job started (sweep jobs: hydra.main)"),
    ("frozen", "parent: run dir frozen"),
    ("launch", "parent: launch called"),
    ("checks_done", "parent: checks passed, go"),
    ("rank_start", "rank 0: process started"),
    ("rank_imported", "rank 0: imports done"),
    ("process_group", "rank 0: process group"),
    ("built", "rank 0: model, data, strategy, engine"),
    ("first_step", "rank 0: first optimizer step done"),
]


def report(results: dict[str, list[dict[str, Any]]], load: tuple[float, float]) -> None:
    kinds = [k for k in KINDS if results.get(k)]
    med = {k: _medians(results[k]) for k in kinds}
    print(
        f"\n{len(results['bare'])} interleaved repeats; load (1 min) before {load[0]:.2f}, after {load[1]:.2f}"
    )
    print("median seconds from exec (step: since the previous phase shown)")
    print(f"{'phase':52s}" + "".join(f"{k:>17s}" for k in kinds))
    shown = [(p, label) for p, label in PHASES if any(p in med[k] for k in kinds)]
    for phase, label in shown:
        row = f"{phase + ' (' + label + ')':52.52s}"
        for k in kinds:
            t = med[k].get(phase)
            prev = [med[k][p] for p, _ in shown[: shown.index((phase, label))] if p in med[k]]
            row += (
                f"{'-':>17s}"
                if t is None
                else f"{t:8.2f} {('+' + format(t - prev[-1], '.2f')) if prev else '':>8s}"
            )
        print(row)
    for k in kinds:
        if k != "bare" and med[k].get("compose_count"):
            print(f"compose x {med[k]['compose_count']:.0f} per run ({k})")
    print("CPU seconds of the process itself (load-proof): parent until launch / rank 0 until built")
    for k in kinds:
        launch_cpu, built_cpu = med[k].get("parent_cpu_to_launch"), med[k].get("rank0_cpu_to_built")
        print(
            f"  {k:14s} {'-' if launch_cpu is None else format(launch_cpu, '.2f'):>6s} / "
            f"{'-' if built_cpu is None else format(built_cpu, '.2f'):>6s}"
        )
    base = med["bare"]["first_step"]
    for k in kinds:
        if k == "bare":
            continue
        extra = med[k]["first_step"] - base
        ratio = med[k]["first_step"] / base
        ok = "meets" if extra <= TARGET_S else "misses"
        print(
            f"verdict: {k}: first step {extra:+.2f} s vs bare torchrun ({ratio:.2f}x); {ok} <= +{TARGET_S} s"
        )
    for k in kinds:
        if f"{k}@base" in med:
            gained = med[f"{k}@base"]["first_step"] - med[k]["first_step"]
            print(
                f"{k}: {gained:+.2f} s sooner than the base tree's ({gained / base:.2f} of a bare first step)"
            )


def _medians(runs: list[dict[str, Any]]) -> dict[str, float]:
    phases = set().union(*runs)
    return {p: statistics.median(r[p] for r in runs if p in r) for p in phases}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="steps per run (only the first is timed)")
    parser.add_argument("--kinds", default="bare,default,user")
    parser.add_argument("--base-tree", help="another checkout (e.g. main): its default and user jobs too")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _bare_rank(args.steps)
        return
    kinds = [k for k in args.kinds.split(",") if k]
    if args.base_tree:
        kinds += [f"{k}@base" for k in kinds if k != "bare" and "@" not in k]
    if "bare" not in kinds:
        kinds.insert(0, "bare")
    results: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench_first_step_") as tmp:
        run_once("bare", Path(tmp), "warm", args.steps)  # untimed: warms the file cache
        for r in range(args.repeats):
            order = kinds[r % len(kinds) :] + kinds[: r % len(kinds)]
            for kind in order:
                res = run_once(kind, Path(tmp), str(r), args.steps, args.base_tree)
                results[kind].append(res)
                print(
                    f"repeat {r + 1}/{args.repeats} {kind:8s} first step {res['first_step']:6.2f} s "
                    f"(load {os.getloadavg()[0]:.2f})",
                    file=sys.stderr,
                    flush=True,
                )
    report(results, (load_before, os.getloadavg()[0]))


if __name__ == "__main__":
    main()
