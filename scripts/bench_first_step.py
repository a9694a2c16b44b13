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

`--full` (issue 37) runs the whole default job (10 epochs, 220 steps, validation each epoch, the
final checkpoint) beside a bare torchrun script doing the same work (the same loop, a validation
all-reduce per epoch, torch.save of the model at the end), and reports what a user waits for:
Enter to the first line on the console, Enter to the first step, `done:` (the bare script's own
last line) to the process's exit, the total wall time and the CPU seconds of every process the
command started (this script is their subreaper, so a helper that outlives the command counts):

    python scripts/bench_first_step.py --full --repeats 3   # goals: first line <= 0.3 s,
                                                           # done: to exit <= 0.5 s, wall <= bare + 1 s
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


def _bare_rank(steps: int, epochs: int = 0) -> None:
    """One rank of the bare loop: what any torchrun script does before its first step. `epochs`
    (--full): the default job's work instead: that many epochs of the 80 % split, a validation
    all-reduce per epoch on the rest, the model saved at the end, then a `done:` line."""
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
    if epochs:
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(0))
        cut = int(0.8 * len(data))
        val = TensorDataset(x[order[cut:]], y[order[cut:]])
        data = TensorDataset(x[order[:cut]], y[order[:cut]])
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10)
    )
    model = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sampler = DistributedSampler(data, world, rank, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(data, batch_size=32, sampler=sampler, drop_last=True)
    _mark("built")
    if epochs:
        _bare_epochs(model, optimizer, sampler, loader, val, epochs)
        return
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


def _bare_epochs(model: Any, optimizer: Any, sampler: Any, loader: Any, val: Any, epochs: int) -> None:
    """--full: the default job's loop, as a torchrun script writes it."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, DistributedSampler

    rank, world = dist.get_rank(), dist.get_world_size()
    val_loader = DataLoader(val, batch_size=32, sampler=DistributedSampler(val, world, rank, shuffle=False))
    steps = 0
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        model.train()
        for xb, yb in loader:
            F.cross_entropy(model(xb), yb).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            steps += 1
            if steps == 1:
                _mark("first_step")
        model.eval()
        sums = torch.zeros(3, dtype=torch.float64)
        with torch.no_grad():
            for xb, yb in val_loader:
                out = model(xb)
                sums += torch.tensor([F.cross_entropy(out, yb, reduction="sum").item(),
                                      (out.argmax(1) == yb).sum().item(), len(yb)], dtype=torch.float64)  # fmt: skip
        dist.all_reduce(sums)
    if rank == 0:
        torch.save(model.module.state_dict(), "model.pt")
        print(
            f"done: {steps} steps, val/acc={sums[1] / sums[2]:.4f} val/loss={sums[0] / sums[2]:.4f}",
            flush=True,
        )
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------ parent side
FULL_EPOCHS = 10  # the default job's trainer.max_epochs


def command(kind: str, steps: int, full: bool = False) -> list[str]:
    if kind == "bare":
        return [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            os.path.abspath(__file__), "--worker", "--steps", str(steps),
            *(["--epochs", str(FULL_EPOCHS)] if full else []),
        ]  # fmt: skip
    if full:  # the console script, as a user types it: the default job, to its end
        return [os.path.join(os.path.dirname(sys.executable), "disttrain"), "train"]
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


def run_full(kind: str, work: Path, tag: str) -> dict[str, float]:
    """--full: one command to its end, its output read as it comes (raw reads, each line timed);
    times from Enter (the moment this script starts it), CPU of every process it started."""
    import resource
    import selectors

    cwd = work / f"{kind}_full_{tag}"
    cwd.mkdir()
    env = {**os.environ, TIMING: str(cwd / "timing.txt")}
    env.pop("OMP_NUM_THREADS", None)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    began = time.time()
    proc = subprocess.Popen(
        command(kind, 3, full=True), cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    times: dict[str, float] = {}
    pending = {proc.stdout: b"", proc.stderr: b""}
    with selectors.DefaultSelector() as sel:
        for stream in pending:
            sel.register(stream, selectors.EVENT_READ)
        while sel.get_map():
            for key, _ in sel.select():
                chunk = os.read(key.fileobj.fileno(), 65536)  # type: ignore[arg-type]
                now = time.time() - began
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                if kind != "bare":  # the bare script says nothing before its `done:`
                    times.setdefault("first_line", now)
                pending[key.fileobj] += chunk  # type: ignore[index]
                if b"\ndone: " in b"\n" + pending[key.fileobj]:  # type: ignore[index]
                    times.setdefault("done", now)
    proc.wait()
    times["exit"] = time.time() - began
    while True:  # the command's helpers that outlived it (reparented here): their CPU counts
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            break
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    times["cpu"] = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} exited {proc.returncode}: {pending[proc.stderr][-2000:]!r}")
    marks, _ = read_marks(cwd / "timing.txt", proc.pid)
    if kind == "bare":
        times["first_step"] = marks["first_step"][0] - began
    else:
        (summary,) = cwd.glob("runs/*/*/summary.json")
        times["first_step"] = json.loads(summary.read_text())["first_step_at"] - began
    return times


def report_full(results: dict[str, list[dict[str, float]]], load: tuple[float, float]) -> None:
    med = {k: _medians(v) for k, v in results.items()}  # type: ignore[arg-type]
    print(
        f"\n--full: {len(results['bare'])} interleaved repeats; load (1 min) before {load[0]:.2f}, after {load[1]:.2f}"
    )
    print(f"{'median seconds':34s}{'bare torchrun':>16s}{'disttrain train':>17s}   goal")
    rows = [
        ("Enter to first line", "first_line", f"<= {FIRST_LINE_GOAL_S} s"),
        ("Enter to first step", "first_step", ""),
        ("done: to exit", "done_to_exit", f"<= {EXIT_GOAL_S} s"),
        ("total wall", "exit", "<= bare + 1 s"),
        ("CPU seconds (all processes)", "cpu", ""),
    ]
    for label, key, goal in rows:
        cells = [med[k].get(key) for k in ("bare", "default")]
        shown = "".join(f"{'-' if c is None else format(c, '.2f'):>16s}" for c in cells)
        print(f"{label:34s}{shown}   {goal}")
    d, b = med["default"], med["bare"]
    verdicts = [
        ("first line", d["first_line"] <= FIRST_LINE_GOAL_S),
        ("done: to exit", d["done_to_exit"] <= EXIT_GOAL_S),
        ("total wall", d["exit"] <= b["exit"] + WALL_GOAL_S),
    ]
    print("verdict: " + "; ".join(f"{name} {'meets' if ok else 'misses'}" for name, ok in verdicts))


FIRST_LINE_GOAL_S, EXIT_GOAL_S, WALL_GOAL_S = 0.3, 0.5, 1.0


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
    parser.add_argument("--full", action="store_true", help="the whole default job beside a bare script")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--epochs", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _bare_rank(args.steps, args.epochs)
        return
    if args.full:
        _main_full(args.repeats)
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


def _main_full(repeats: int) -> None:
    import ctypes

    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphaned helpers come here
    results: dict[str, list[dict[str, float]]] = {"bare": [], "default": []}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench_first_step_") as tmp:
        run_full("bare", Path(tmp), "warm")  # untimed: warms the file cache
        for r in range(repeats):
            for kind in ("bare", "default") if r % 2 == 0 else ("default", "bare"):
                res = run_full(kind, Path(tmp), str(r))
                res["done_to_exit"] = res["exit"] - res["done"]
                results[kind].append(res)
                print(
                    f"repeat {r + 1}/{repeats} {kind:8s} "
                    + " ".join(f"{k} {v:.2f}" for k, v in sorted(res.items()))
                    + f" (load {os.getloadavg()[0]:.2f})",
                    file=sys.stderr,
                    flush=True,
                )
    report_full(results, (load_before, os.getloadavg()[0]))


if __name__ == "__main__":
    main()
