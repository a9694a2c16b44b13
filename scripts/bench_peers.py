"""The same workload through a bare torchrun DDP loop, Lightning Fabric, Accelerate and disttrain.

Workload (identical on every side): the reference MLP (disttrain.models.mlp) on the synthetic data
set, 2 gloo ranks on CPU with 1 intra-op thread each, AdamW, cross-entropy, gradient clipping at
1.0, batch 32 per rank, one rank-averaged loss log every `--log-every` steps, no validation, no
checkpoint. Every side is started by torchrun (disttrain by its own CLI, whose default launcher is
torchrun's elastic agent), so "launch" means the same thing everywhere: the moment this script
starts the command.

Per run:
- step time: steady state, (time of the last log - time of the first log at or after `--warmup`)
  / steps in between;
- launch -> first step: from starting the command to the end of rank 0's first optimizer step;
- peak RSS per rank: the largest VmHWM among the rank processes (those with LOCAL_RANK set),
  sampled from /proc while the run lives.

Runs are interleaved (bare, fabric, accelerate, disttrain, then the next repeat in rotated order);
each row is the median over repeats and the ratio is against the bare loop. A peer whose package is
not installed is skipped with a note (`pip install lightning accelerate`).

    python scripts/bench_peers.py             # 5 repeats, ~3 min on a quiet 2-core machine
    python scripts/bench_peers.py --repeats 3 --steps 200
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench_overhead import _descendants  # scripts/ is sys.path[0] when a script runs

WORLD, SEED, LR, WEIGHT_DECAY, CLIP = 2, 0, 1e-3, 0.01, 1.0
PEERS = ("bare", "fabric", "accelerate", "disttrain")
PACKAGES = {"fabric": "lightning", "accelerate": "accelerate"}


# ------------------------------------------------------------------------------------ rank side
def _rank(kind: str, opts: dict[str, Any], out: str) -> None:
    """One rank under torchrun: build the same model and data, train with `kind`'s API."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, DistributedSampler

    from disttrain.data.synthetic import make_synthetic
    from disttrain.models.mlp import MLP

    torch.set_num_threads(1)
    data = make_synthetic(opts["samples"], opts["features"], opts["classes"], noise=opts["noise"], seed=1234)
    torch.manual_seed(SEED)
    model: Any = MLP(opts["features"], opts["classes"], opts["hidden"])
    optimizer: Any = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    backward: Any = None
    if kind == "bare":
        from torch.nn.parallel import DistributedDataParallel

        dist.init_process_group("gloo")
        model = DistributedDataParallel(model)  # the optimizer holds the same parameter objects
        rank = dist.get_rank()
        sampler = DistributedSampler(data, WORLD, rank, shuffle=True, seed=SEED, drop_last=True)
        loader = DataLoader(data, batch_size=opts["batch"], sampler=sampler, drop_last=True)
        backward = torch.Tensor.backward
    elif kind == "fabric":
        from lightning.fabric import Fabric

        fabric = Fabric(accelerator="cpu", devices=WORLD, strategy="ddp", precision="32-true")
        fabric.launch()
        model, optimizer = fabric.setup(model, optimizer)
        rank = fabric.global_rank
        sampler = DistributedSampler(data, WORLD, rank, shuffle=True, seed=SEED, drop_last=True)
        loader = fabric.setup_dataloaders(
            DataLoader(data, batch_size=opts["batch"], sampler=sampler, drop_last=True),
            use_distributed_sampler=False,
        )
        backward = fabric.backward
    else:  # accelerate
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=True)
        rank = accelerator.process_index
        loader = DataLoader(data, batch_size=opts["batch"], shuffle=True, drop_last=True)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        backward = accelerator.backward
    first_step_at, records, logged = 0.0, [], 0
    loss_sum = torch.zeros(())
    for step, (x, y) in enumerate(loader, start=1):
        loss = F.cross_entropy(model(x), y)
        backward(loss)
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_sum += loss.detach()
        first_step_at = first_step_at or time.time()
        if step % opts["log_every"] == 0 or step == opts["steps"]:
            dist.all_reduce(loss_sum)
            n, logged = step - logged, step
            records.append({"step": step, "time": time.time(), "loss": loss_sum.item() / WORLD / n})
            loss_sum = torch.zeros(())
        if step == opts["steps"]:
            break
    if rank == 0:
        Path(out).write_text(json.dumps({"first_step_at": first_step_at, "records": records}))
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------ parent side
class PeakRss:
    """The largest VmHWM (peak resident set) among the rank processes below this script."""

    def __init__(self) -> None:
        self.peak_kib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(0.05):
            for pid in _descendants(os.getpid()):
                try:
                    # a rank: LOCAL_RANK in its start environment, or a disttrain rank forked
                    # from the fork server (it names itself `disttrain rN`; the server does not)
                    rank = b"LOCAL_RANK=" in Path(f"/proc/{pid}/environ").read_bytes()
                    if not rank and not Path(f"/proc/{pid}/comm").read_text().startswith("disttrain r"):
                        continue
                    status = Path(f"/proc/{pid}/status").read_text()
                except OSError:
                    continue
                for line in status.splitlines():
                    if line.startswith("VmHWM:"):
                        self.peak_kib = max(self.peak_kib, int(line.split()[1]))

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _command(kind: str, opts: dict[str, Any], work: Path, tag: str) -> tuple[list[str], Path]:
    if kind == "disttrain":
        run_dir = work / f"disttrain_{tag}"
        hidden = ",".join(str(h) for h in opts["hidden"])
        overrides = [
            f"hydra.run.dir={run_dir}", "backend=gloo", "strategy=ddp", f"nproc_per_node={WORLD}",
            "threads_per_rank=1", "launcher=torchrun", f"seed={SEED}", "data=synthetic",
            f"data.num_features={opts['features']}", f"data.num_classes={opts['classes']}",
            f"data.num_samples={opts['samples']}", f"data.noise={opts['noise']}", "data.val=null",
            "model=mlp", f"model.hidden=[{hidden}]", "optim=adamw", f"optim.lr={LR}",
            f"optim.weight_decay={WEIGHT_DECAY}", "sched=constant", f"trainer.max_steps={opts['steps']}",
            f"trainer.batch_size={opts['batch']}", f"trainer.clip_grad_norm={CLIP}",
            f"trainer.log_every={opts['log_every']}", "trainer.val_every=0", "trainer.ckpt_every=0",
            "trainer.progress=false", "checkpoint.export_final=false",
        ]  # fmt: skip
        return [sys.executable, "-m", "disttrain", "train", *overrides], run_dir
    out = work / f"{kind}_{tag}.json"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}",
        __file__, "--worker", kind, "--out", str(out), "--opts", json.dumps(opts),
    ]  # fmt: skip
    return cmd, out


def run_once(kind: str, opts: dict[str, Any], work: Path, tag: str) -> dict[str, float]:
    cmd, out = _command(kind, opts, work, tag)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with PeakRss() as rss:
        launched = time.time()
        try:  # a hung side fails its row (named) instead of blocking the whole benchmark
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False, timeout=180)
        except subprocess.TimeoutExpired as exc:
            tail = exc.stderr[-1500:] if isinstance(exc.stderr, str) else (exc.stderr or b"")[-1500:]
            raise RuntimeError(f"{kind} did not finish in 180 s: {tail!r}") from None
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} exited {proc.returncode}: {proc.stderr[-1500:]}")
    if kind == "disttrain":
        records = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln]
        records = [{"step": r["step"], "time": r["time"], "loss": r["train/loss"]} for r in records]
        first = json.loads((out / "summary.json").read_text())["first_step_at"]
    else:
        result = json.loads(out.read_text())
        records, first = result["records"], result["first_step_at"]
    steady = [r for r in records if r["step"] >= opts["warmup"]]
    a, b = steady[0], steady[-1]
    return {
        "step_ms": 1e3 * (b["time"] - a["time"]) / (b["step"] - a["step"]),
        "first_step_s": first - launched,
        "peak_rss_mib": rss.peak_kib / 1024,
        "loss": b["loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--worker", choices=PEERS[:3], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--opts", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _rank(args.worker, json.loads(args.opts), args.out)
        return
    opts = {
        "steps": args.steps, "warmup": args.warmup, "log_every": args.log_every, "batch": 32,
        "features": 256, "classes": 10, "hidden": [512, 512], "noise": 16.0,
        "samples": args.steps * 32 * WORLD,
    }  # fmt: skip
    peers = [p for p in PEERS if p not in PACKAGES or importlib.util.find_spec(PACKAGES[p]) is not None]
    for p in set(PEERS) - set(peers):
        print(f"note: {p} skipped ({PACKAGES[p]} is not installed: pip install {PACKAGES[p]})")
    results: dict[str, list[dict[str, float]]] = {p: [] for p in peers}
    failed: dict[str, list[str]] = {}
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench_peers_") as tmp:
        for r in range(args.repeats):
            order = peers[r % len(peers) :] + peers[: r % len(peers)]  # rotate: no side always first
            for kind in order:
                try:
                    results[kind].append(run_once(kind, opts, Path(tmp), f"{r}"))
                except RuntimeError as exc:  # a peer that failed or hung this repeat: noted, skipped
                    failed.setdefault(kind, []).append(str(exc).splitlines()[0][:200])
                    print(f"repeat {r + 1}/{args.repeats} {kind}: FAILED {exc}", file=sys.stderr)
                    continue
                print(f"repeat {r + 1}/{args.repeats} {kind}: {results[kind][-1]}", file=sys.stderr)
    for p, why in failed.items():
        print(f"note: {p} failed {len(why)} of {args.repeats} repeats (medians over the rest): {why[0]}")
    peers = [p for p in peers if results[p]]
    med = {p: {k: statistics.median(run[k] for run in results[p]) for k in results[p][0]} for p in peers}
    base = med["bare"]
    print(
        f"\n{args.repeats} interleaved repeats, {args.steps} steps, 2 gloo ranks x 1 thread; load before: {load:.2f}"
    )
    print(
        f"{'':12s} {'step ms':>9s} {'ratio':>6s} {'1st step s':>11s} {'+s':>6s} {'RSS MiB':>8s} {'ratio':>6s} {'loss':>9s}"
    )
    for p in peers:
        m = med[p]
        print(
            f"{p:12s} {m['step_ms']:9.2f} {m['step_ms'] / base['step_ms']:6.3f} {m['first_step_s']:11.2f} "
            f"{m['first_step_s'] - base['first_step_s']:+6.2f} {m['peak_rss_mib']:8.0f} "
            f"{m['peak_rss_mib'] / base['peak_rss_mib']:6.2f} {m['loss']:9.5f}"
        )
    if "disttrain" in med:
        d = med["disttrain"]
        ahead = [p for p in peers if p != "disttrain" and d["step_ms"] <= med[p]["step_ms"]]
        print(
            f"verdict: disttrain step time {d['step_ms'] / base['step_ms']:.3f}x bare "
            f"(at or ahead of: {', '.join(ahead) or 'none'}); first step "
            f"{d['first_step_s'] - base['first_step_s']:+.2f} s vs bare (target <= +0.30 s)"
        )


if __name__ == "__main__":
    main()
