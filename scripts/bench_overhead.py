"""disttrain's engine vs a hand-written PyTorch DDP loop: same model, data, batch and steps.

Both sides train the reference MLP (disttrain.models.mlp) on the synthetic data set with 2 gloo
ranks on CPU, 1 intra-op thread each, AdamW, cross-entropy, gradient clipping at 1.0, one epoch,
no validation, no intermediate checkpoint, and log the rank-averaged loss every `--log-every`
steps (the only host sync in the plain loop):

- disttrain: `python -m disttrain train ...` in a subprocess, the real launch path (torchrun by
  default, sched=constant); its numbers come from the run dir's metrics.jsonl and summary.json.
- plain: torch.multiprocessing.start_processes from this script; init_process_group(gloo),
  DistributedSampler, DDP, and the bare loop (no scheduler: the lr is constant anyway).

Same seed, data (noise 16, so the loss stays well above 0), init and sample order: the last log
window's loss must come out equal on both sides, which the report shows as a check.

Runs alternate (plain, disttrain, disttrain, plain, ...) and each row is the median over repeats.

- step time, steady state: (time of the last log - time of the first log at or after `--warmup`)
  / steps in between: every per-step cost counts, logging included.
- window median: the per-window time the engine logs as `step_time_s` (the plain loop times its
  windows the same way); it leaves out the log itself.
- CPU per step: CPU seconds of all the run's processes (ranks, launcher) over the same steady-state
  window, sampled from /proc. On a shared machine other processes inflate wall time far more than
  CPU time; the share of the CPUs they used in the window is printed, with a warning above 5%.
- time to first step: from the launch call (disttrain: `launch()`, after the config is composed and
  the run dir frozen) to the end of the first optimizer step on rank 0; for disttrain also from
  the exec of `disttrain train`.

    python scripts/bench_overhead.py            # ~2-3 min on a quiet 2-core machine
    python scripts/bench_overhead.py --quick    # ~30 s
    python scripts/bench_overhead.py --sweep    # model-size sweep 0.04 M -> 50 M parameters, ~10 min

The sweep (`--sweep`, or `--sweep 128/512,512/4096,4096` for your own hidden widths) repeats the
comparison per model size with fewer steps for the big ones and prints, per size, the parameter
count, both step times, disttrain's overhead per step in ms and in % of the plain step: the engine's
fixed per-step cost should fall towards 0 % as the work per step grows.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WORLD = 2
SEED = 0
LR, WEIGHT_DECAY, CLIP = 1e-3, 0.01, 1.0
TARGET = 1.03
CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
BUSY_WARN = 0.05  # other processes using more than this share of the machine make a run suspect
SWEEP = "128/512,512/2048,2048/4096,4096,4096/5120,5120,5120"  # ~0.04 M .. ~54 M parameters
SWEEP_FLOPS = 1.5e9  # ~FLOPs one rank spends per timed run and size: few steps for big models


class RunFailed(RuntimeError):
    """A run that did not finish; the benchmark retries it once and reports it."""


@dataclass
class Run:
    step_ms: float  # steady state, from log timestamps
    window_ms: float  # median per-window step time (the engine's step_time_s)
    first_step_s: float  # launch -> first optimizer step done, rank 0
    first_step_exec_s: float | None = None  # disttrain: exec of `disttrain train` -> first step
    cpu_ms: float | None = None  # CPU time per steady-state step, all processes of the run together
    foreign: float | None = None  # share of the machine other processes kept busy in that window
    loss: float | None = None  # mean train loss of the last log window: the same work gives the same value


# ------------------------------------------------------------------------------------- measuring
def _proc_cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0  # exited between listing and reading
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime, every thread


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        try:
            kids = [
                int(k)
                for t in Path(f"/proc/{todo.pop()}/task").iterdir()
                for k in (t / "children").read_text().split()
            ]
        except OSError:
            continue  # exited while we looked
        found += kids
        todo += kids
    return found


class CpuSampler:
    """Samples the CPU time of this script's descendants and of the whole machine (Linux /proc).

    Charging a run's steady-state window in CPU time gives a per-step cost that other processes on a
    shared machine barely disturb, and the machine's busy time minus ours says how busy they kept it.
    """

    def __init__(self, interval: float = 0.05) -> None:
        self.interval = interval
        self.samples: list[tuple[float, float, float, float]] = []  # time, ours, machine busy, this script
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _sample(self) -> None:
        ours = sum(_proc_cpu_s(pid) for pid in _descendants(os.getpid()))
        head = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in head)
        busy = (user + nice + system + irq + softirq + steal) / CLK_TCK
        self.samples.append((time.time(), ours, busy, time.process_time()))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._sample()
            except OSError:
                return  # no /proc: CPU columns stay empty

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _at(self, t: float) -> list[float]:
        """The sampled counters linearly interpolated at time `t`."""
        for a, b in itertools.pairwise(self.samples):
            if a[0] <= t <= b[0]:
                w = (t - a[0]) / (b[0] - a[0])
                return [x + w * (y - x) for x, y in zip(a[1:], b[1:], strict=True)]
        raise ValueError("time outside the sampled range")

    def window(self, t0: float, t1: float) -> tuple[float, float] | None:
        """(CPU seconds of our processes, share of all cores other processes used) between t0 and t1."""
        try:
            (ours0, busy0, me0), (ours1, busy1, me1) = self._at(t0), self._at(t1)
        except ValueError:
            return None
        others = (busy1 - busy0) - (ours1 - ours0) - (me1 - me0)
        return ours1 - ours0, max(0.0, others) / ((t1 - t0) * (os.cpu_count() or 1))


def steady_state(
    records: list[dict[str, Any]], warmup: int, cpu: CpuSampler, first_step_s: float, loss_key: str
) -> Run:
    """Per-step costs between the first log at or after `warmup` and the last log."""
    steady = [r for r in records if r["step"] >= warmup]
    if len(steady) < 2:
        raise SystemExit(f"need two logs at or after step {warmup}; got steps {[r['step'] for r in records]}")
    first, last = steady[0], steady[-1]
    steps = last["step"] - first["step"]
    run = Run(
        step_ms=1e3 * (last["time"] - first["time"]) / steps,
        window_ms=1e3 * statistics.median(r["step_time_s"] for r in steady[1:]),
        first_step_s=first_step_s,
        loss=last[loss_key],
    )
    window = cpu.window(first["time"], last["time"])
    if window is not None:
        run.cpu_ms, run.foreign = 1e3 * window[0] / steps, window[1]
    return run


# ----------------------------------------------------------------------------------- plain DDP loop
def _disttrain_module(relpath: str) -> Any:
    """One disttrain file (torch only), loaded without its package __init__s (Hydra, OmegaConf):
    the plain side uses the same model and data code but pays no import it would not have."""
    import importlib.util

    package = importlib.util.find_spec("disttrain")
    assert package is not None and package.submodule_search_locations, "disttrain is not installed"
    path = Path(package.submodule_search_locations[0]) / relpath
    spec = importlib.util.spec_from_file_location(f"bench_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _plain_rank(rank: int, opts: dict[str, Any], port: int, out: str) -> None:
    """One rank of the hand-written loop; rank 0 writes its log records and first-step time to `out`."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        result = _plain_train(rank, opts)
        if rank == 0:
            Path(out).write_text(json.dumps(result))
        gc.collect()  # free the DDP model before its group: fewer gloo SIGABRTs at exit (torch 2.13)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _plain_train(rank: int, opts: dict[str, Any]) -> dict[str, Any]:
    """The loop a user would write: DDP, AdamW, cross-entropy, clipping, a rare rank-averaged log."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    make_synthetic = _disttrain_module("data/synthetic.py").make_synthetic
    data = make_synthetic(opts["samples"], opts["features"], opts["classes"], noise=opts["noise"], seed=1234)
    torch.manual_seed(SEED)  # the same initial weights as disttrain's (and on every rank)
    model = DistributedDataParallel(
        _disttrain_module("models/mlp.py").MLP(opts["features"], opts["classes"], opts["hidden"])
    )
    torch.manual_seed(SEED + rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    sampler: DistributedSampler = DistributedSampler(
        data, WORLD, rank, shuffle=True, seed=SEED, drop_last=True
    )
    loader = DataLoader(data, batch_size=opts["batch"], sampler=sampler, drop_last=True)
    steps, log_every = opts["steps"], opts["log_every"]
    first_step_at, records, logged = 0.0, [], 0
    loss_sum, window = torch.zeros(()), time.perf_counter()
    sampler.set_epoch(0)  # one epoch: the data set holds exactly `steps` batches per rank
    for step, (x, y) in enumerate(loader, start=1):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_sum += loss.detach()
        first_step_at = first_step_at or time.time()
        if step % log_every == 0 or step == steps:
            elapsed = time.perf_counter() - window
            dist.all_reduce(loss_sum)
            n, logged = step - logged, step
            mean = loss_sum.item() / WORLD / n
            records.append({"step": step, "time": time.time(), "loss": mean, "step_time_s": elapsed / n})
            loss_sum, window = torch.zeros(()), time.perf_counter()
        if step == steps:
            break
    return {"first_step_at": first_step_at, "records": records}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_plain(opts: dict[str, Any], work: Path, tag: str) -> Run:
    import torch.multiprocessing as mp

    out = work / f"plain_{tag}.json"
    os.environ["OMP_NUM_THREADS"] = "1"  # the children inherit it, as disttrain's ranks do
    with CpuSampler() as cpu:
        launched = time.time()
        try:
            mp.start_processes(_plain_rank, (opts, free_port(), str(out)), nprocs=WORLD, start_method="spawn")
        except mp.ProcessExitedException as exc:
            raise RunFailed(str(exc)) from None
    result = json.loads(out.read_text())
    return steady_state(result["records"], opts["warmup"], cpu, result["first_step_at"] - launched, "loss")


# -------------------------------------------------------------------------------------- disttrain
def disttrain_command(opts: dict[str, Any], run_dir: Path) -> list[str]:
    hidden = ",".join(str(h) for h in opts["hidden"])
    overrides = [
        f"hydra.run.dir={run_dir}",
        "backend=gloo",
        "strategy=ddp",
        f"nproc_per_node={WORLD}",
        "threads_per_rank=1",
        f"launcher={opts['launcher']}",
        f"seed={SEED}",
        "data=synthetic",
        f"data.num_features={opts['features']}",
        f"data.num_classes={opts['classes']}",
        f"data.num_samples={opts['samples']}",
        f"data.noise={opts['noise']}",
        "data.val=null",
        "model=mlp",
        f"model.hidden=[{hidden}]",
        "optim=adamw",
        f"optim.lr={LR}",
        f"optim.weight_decay={WEIGHT_DECAY}",
        "sched=constant",
        f"trainer.max_steps={opts['steps']}",
        f"trainer.batch_size={opts['batch']}",
        "trainer.grad_accum=1",
        f"trainer.clip_grad_norm={CLIP}",
        f"trainer.log_every={opts['log_every']}",
        "trainer.val_every=0",
        "trainer.ckpt_every=0",
        f"trainer.progress={str(opts['progress']).lower()}",
    ]
    return [sys.executable, "-m", "disttrain", "train", *overrides]


def run_disttrain(opts: dict[str, Any], work: Path, tag: str) -> Run:
    run_dir = work / f"disttrain_{tag}"
    cmd = disttrain_command(opts, run_dir)
    log_path = work / f"disttrain_{tag}.out"
    with CpuSampler() as cpu, log_path.open("w") as log:
        started = time.time()
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0:
        lines = log_path.read_text().splitlines()
        said = [ln for ln in lines if "terminate called" in ln or ln.startswith("disttrain:")] or lines[-3:]
        raise RunFailed(f"exit {proc.returncode}: {' | '.join(said)} (full output: {log_path})")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    summary = json.loads((run_dir / "summary.json").read_text())
    train = [r for r in records if "step_time_s" in r]
    run = steady_state(train, opts["warmup"], cpu, summary["time_to_first_step_s"], "train/loss")
    run.first_step_exec_s = summary["first_step_at"] - started
    return run


# ---------------------------------------------------------------------------------------- report
def median(runs: list[Run], field: str) -> float | None:
    values = [v for v in (getattr(r, field) for r in runs) if v is not None]
    return statistics.median(values) if values else None


def _cell(value: float | None, fmt: str) -> str:
    return format(value, fmt) if value is not None else format("n/a", ">11")


def report(opts: dict[str, Any], plain: list[Run], ours: list[Run]) -> None:
    hidden = "-".join(str(h) for h in opts["hidden"])
    print(
        f"\nMLP {opts['features']}-{hidden}-{opts['classes']}, batch {opts['batch']}/rank, {WORLD} gloo ranks "
        f"x 1 thread, {opts['steps']} steps (first {opts['warmup']} skipped), log every {opts['log_every']}, "
        f"disttrain launcher={opts['launcher']} progress={opts['progress']}; "
        f"median of {len(plain)} interleaved repeats\n"
    )
    rows = [  # label, Run field, cell format, show the ratio
        ("step time, steady state (ms)", "step_ms", ">11.2f", True),
        ("step time, window median (ms)", "window_ms", ">11.2f", True),
        ("CPU per step, all processes (ms)", "cpu_ms", ">11.2f", True),
        ("time to first step from launch (s)", "first_step_s", ">11.2f", False),
        ("  disttrain: from `disttrain train` exec", "first_step_exec_s", ">11.2f", False),
        ("other processes' share of the CPUs", "foreign", ">11.0%", False),
        ("train loss, last window (same work: equal)", "loss", ">11.5f", True),
    ]
    print(f"{'':42}{'plain DDP':>11}{'disttrain':>11}{'ratio':>8}")
    for name, field, fmt, with_ratio in rows:
        x, y = median(plain, field), median(ours, field)
        r = f"{y / x:>8.3f}" if with_ratio and x and y else ""
        print(f"{name:42}{_cell(x, fmt)}{_cell(y, fmt)}{r}")
    print("\nper repeat (plain / disttrain):")
    for i, (a, b) in enumerate(zip(plain, ours, strict=True)):
        cpu = f"cpu {a.cpu_ms:.2f} / {b.cpu_ms:.2f} ms" if a.cpu_ms and b.cpu_ms else ""
        busy = (
            f"others busy {a.foreign:.0%} / {b.foreign:.0%}"
            if a.foreign is not None and b.foreign is not None
            else ""
        )
        print(
            f"  {i + 1}: step {a.step_ms:.2f} / {b.step_ms:.2f} ms = {b.step_ms / a.step_ms:.3f}  {cpu}  {busy}"
        )
    ratio, verdict = judge(plain, ours)
    print(f"\nstep-time ratio disttrain/plain = {ratio:.3f} (target <= {TARGET}): {verdict}")


def judge(plain: list[Run], ours: list[Run]) -> tuple[float, str]:
    """The step-time ratio and its verdict, from the pairs no other process disturbed if some were."""
    quiet = [(a, b) for a, b in zip(plain, ours, strict=True) if _quiet(a) and _quiet(b)]
    if not quiet:
        print(f"\nWARNING: other processes kept more than {BUSY_WARN:.0%} of the CPUs busy in every pair.")
        ratio = median(ours, "step_ms") / median(plain, "step_ms")  # type: ignore[operator]
        return ratio, "NO VERDICT: every pair was contended; rerun on a quiet machine"
    ratio = statistics.median(b.step_ms for _, b in quiet) / statistics.median(a.step_ms for a, _ in quiet)
    verdict = "OK" if ratio <= TARGET else "ABOVE TARGET"
    if len(quiet) < len(plain):
        print(
            f"\nWARNING: in {len(plain) - len(quiet)} of {len(plain)} pairs other processes kept more than "
            f"{BUSY_WARN:.0%} of the CPUs busy while steps were timed; that inflates wall-clock time (a rank "
            "waits for a descheduled peer) far more than CPU per step. The verdict uses the other pairs."
        )
        verdict += f" (the {len(quiet)} quiet pair{'s' * (len(quiet) > 1)} only)"
    return ratio, verdict


def _quiet(run: Run) -> bool:
    return run.foreign is None or run.foreign <= BUSY_WARN  # None: no /proc, contention unknown


# ------------------------------------------------------------------------------------------ main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--steps", type=int, default=400, help="optimizer steps per run (default 400)")
    p.add_argument("--repeats", type=int, default=8, help="interleaved runs of each side (default 8)")
    p.add_argument("--batch", type=int, default=32, help="samples per rank per step (default 32)")
    p.add_argument("--hidden", type=str, default="512,512", help="MLP hidden widths (default 512,512)")
    p.add_argument("--features", type=int, default=256, help="input width (default 256)")
    p.add_argument("--classes", type=int, default=10, help="number of classes (default 10)")
    p.add_argument(
        "--noise", type=float, default=16.0, help="synthetic data noise; keeps the loss off 0 (16)"
    )
    p.add_argument("--log-every", type=int, default=50, help="steps between loss logs (default 50)")
    p.add_argument("--warmup", type=int, default=50, help="steps skipped before timing (default 50)")
    p.add_argument("--launcher", choices=["torchrun", "spawn"], default="torchrun", help="disttrain launcher")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="trainer.progress=false")
    p.add_argument(
        "--quick", action="store_true", help="~30 s: 120 steps, 2 repeats, log every 20, no warm-up run"
    )
    p.add_argument("--keep", action="store_true", help="keep the run dirs (printed) instead of deleting them")
    p.add_argument(
        "--sweep",
        nargs="?",
        const=SWEEP,
        default=None,
        help=f"model-size sweep: hidden widths per size, sizes separated by / (default {SWEEP})",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.repeats, args.log_every, args.warmup = 120, 2, 20, 20
    if args.warmup % args.log_every or args.steps - args.warmup < 2 * args.log_every:
        p.error(
            f"--warmup ({args.warmup}) must be a multiple of --log-every ({args.log_every}) and leave at "
            f"least two log windows before --steps ({args.steps})"
        )
    return args


def attempt(name: str, fn: Any, opts: dict[str, Any], work: Path, tag: str, failures: list[str]) -> Run:
    """Run once; a failed run is recorded and tried once more, a second failure stops the benchmark."""
    try:
        return fn(opts, work, tag)
    except RunFailed as exc:
        failures.append(f"{name} run {tag}: {exc}")
        print(f"{name} run {tag} FAILED, retrying once: {exc}", flush=True)
    try:
        return fn(opts, work, f"{tag}_retry")
    except RunFailed as exc:
        raise SystemExit(f"{name} run {tag} failed twice: {exc}") from None


def mlp_params(features: int, hidden: list[int], classes: int) -> int:
    widths = [features, *hidden, classes]
    return sum(a * b + b for a, b in itertools.pairwise(widths))


def sweep(args: argparse.Namespace, base: dict[str, Any], work: Path, failures: list[str]) -> None:
    """The comparison once per model size: overhead per step in ms and in % of the plain step."""
    rows = []
    for size, spec in enumerate(args.sweep.split("/")):
        hidden = [int(h) for h in spec.split(",")]
        params = mlp_params(base["features"], hidden, base["classes"])
        flops_per_step = 6 * params * base["batch"]
        log_every = 10
        steps = max(
            6 * log_every, min(args.steps, int(SWEEP_FLOPS * 40 / flops_per_step) // log_every * log_every)
        )
        opts = {**base, "hidden": hidden, "steps": steps, "log_every": log_every, "warmup": 2 * log_every}
        opts["samples"] = steps * base["batch"] * WORLD
        plain: list[Run] = []
        ours: list[Run] = []
        for i in range(args.repeats):
            order = [(run_plain, plain), (run_disttrain, ours)]
            for fn, runs in order if i % 2 == 0 else order[::-1]:
                runs.append(attempt(fn.__name__, fn, opts, work, f"size{size}_{i}", failures))
        ratio, verdict = judge(plain, ours)
        a, b = median(plain, "step_ms"), median(ours, "step_ms")
        assert a is not None and b is not None
        rows.append((params, steps, a, b, ratio, verdict))
        print(
            f"{params / 1e6:8.2f} M params, {steps} steps: plain {a:.2f} ms, disttrain {b:.2f} ms", flush=True
        )
    print(
        f"\nmodel-size sweep, median of {args.repeats} interleaved repeats per size (2 gloo ranks x 1 thread)"
    )
    print(
        f"{'params':>10}{'steps':>7}{'plain ms':>10}{'disttrain ms':>14}{'overhead ms':>13}{'overhead':>10}  verdict"
    )
    for params, steps, a, b, ratio, verdict in rows:
        print(
            f"{params / 1e6:9.2f}M{steps:>7}{a:>10.2f}{b:>14.2f}{b - a:>13.2f}{ratio - 1:>10.1%}  {verdict}"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    opts = {
        "steps": args.steps,
        "batch": args.batch,
        "hidden": [int(h) for h in args.hidden.split(",")],
        "features": args.features,
        "classes": args.classes,
        "noise": args.noise,
        "log_every": args.log_every,
        "warmup": args.warmup,
        "launcher": args.launcher,
        "progress": args.progress,
        "samples": args.steps * args.batch * WORLD,  # exactly one epoch: no epoch boundary inside the run
    }
    work = Path(tempfile.mkdtemp(prefix="bench_overhead_"))
    plain: list[Run] = []
    ours: list[Run] = []
    failures: list[str] = []
    if args.sweep:
        try:
            sweep(args, opts, work, failures)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return 0
    try:
        if not args.quick:  # untimed: warms the file cache for the first pair's time to first step
            attempt(
                "warm-up", run_plain, {**opts, "steps": 2 * args.log_every, "warmup": 0}, work, "w", failures
            )
        for i in range(args.repeats):
            order = [("plain", run_plain, plain), ("disttrain", run_disttrain, ours)]
            for name, fn, runs in order if i % 2 == 0 else order[::-1]:
                run = attempt(name, fn, opts, work, str(i), failures)
                runs.append(run)
                busy = "" if run.foreign is None else f", others busy {run.foreign:.0%}"
                cpu = "" if run.cpu_ms is None else f", cpu {run.cpu_ms:6.2f} ms"
                print(
                    f"repeat {i + 1}/{args.repeats} {name:9} step {run.step_ms:6.2f} ms{cpu}, "
                    f"first step {run.first_step_s:5.2f} s{busy}",
                    flush=True,
                )
        report(opts, plain, ours)
        for failure in failures:
            print(f"FAILED RUN (retried): {failure}")
    finally:
        if args.keep:
            print(f"run dirs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
