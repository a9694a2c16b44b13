"""data=tokens at scale: RSS per rank on a 2 GB token file against a 2 MB one, loader tokens/s
against nanoGPT's `get_batch`, and the loader's share of a GPT step (data_wait_frac).

Generates, in a temporary directory, a 2 GB uint16 token file (sparse: no 2 GB of disk writes; its
holes read as token 0; --dense writes random tokens instead) and a 2 MB one of random tokens, then

1. trains `model=gpt data=tokens` on each through the CLI (2 gloo ranks, the same steps), sampling
   every rank's RSS from /proc while it runs: the peaks side by side (issue 24: within 200 MB);
2. reads batches of the same shape from the 2 GB file, in this process, both ways, interleaved
   rounds, median tokens/s: disttrain's training loader (make_loaders over load_tokens, random
   windows) and nanoGPT's `get_batch` (a fresh np.memmap per batch, torch.randint offsets); ratio;
3. reports `data_wait_frac` (time waiting for batches / step time) from the 2 GB run's metrics.

    python scripts/bench_data.py            # ~2 min on 2 busy cores
    python scripts/bench_data.py --steps 40 --rounds 7
"""

from __future__ import annotations

import argparse
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

import numpy as np
import torch

BIG = 2 * 1024**3  # bytes
SMALL = 2 * 1024**2


def make_files(folder: Path, dense: bool, vocab: int) -> tuple[Path, Path]:
    big, small = folder / "big.bin", folder / "small.bin"
    rng = np.random.default_rng(0)
    rng.integers(0, vocab, SMALL // 2).astype(np.uint16).tofile(small)
    with open(big, "wb") as f:
        if dense:  # 64 MB of random tokens written 32 times: fast, and not all one token
            chunk = rng.integers(0, vocab, 32 * 1024**2).astype(np.uint16).tobytes()
            for _ in range(BIG // len(chunk)):
                f.write(chunk)
        else:
            f.truncate(BIG)  # sparse: its holes read as zeros
            f.write(rng.integers(0, vocab, SMALL // 2).astype(np.uint16).tobytes())
    return big, small


def rss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def train(path: Path, run_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One CLI run on `path`; each rank's peak RSS (MB) sampled from /proc, and its metrics."""
    from disttrain.procs import rank_pids

    cmd = [
        sys.executable, "-m", "disttrain", "train", "model=gpt", "data=tokens", f"data.path={path}",
        f"data.block_size={args.block}", f"data.num_classes={args.vocab}", "data.val_fraction=0.001",
        "trainer.val_batches=2", f"trainer.batch_size={args.batch}", f"trainer.max_steps={args.steps}",
        "trainer.log_every=5", "trainer.progress=false", "nproc_per_node=2", "backend.name=gloo",
        "threads_per_rank=1", f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    peaks: dict[int, int] = {}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            status = run_dir / "status.json"
            if status.is_file():
                try:
                    pids = rank_pids(json.loads(status.read_text())["pid"])
                except (ValueError, KeyError, OSError):
                    pids = {}
                for rank, pid in pids.items():
                    peaks[rank] = max(peaks.get(rank, 0), rss_kb(pid))
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, _ = proc.communicate()
    done.set()
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}\n{out[-3000:]}")
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in records if "train/loss" in r]
    return {"rss_mb": {r: kb / 1024 for r, kb in sorted(peaks.items())}, "rows": train_rows}


def disttrain_loader(path: Path, args: argparse.Namespace) -> Any:
    """The training loader data=tokens gets on rank 0 of 2 (random windows, no workers)."""
    from disttrain.config import compose, resolve
    from disttrain.config.run import Run
    from disttrain.data.loaders import make_loaders
    from disttrain.data.tokens import load_tokens

    data = {"num_workers": 0, "pin_memory": False, "persistent_workers": False, "prefetch_factor": None}
    data |= {"shuffle": False, "drop_last": True}
    run = Run.of(resolve(compose([]))).updated(
        {"data": data, "trainer": {"batch_size": args.batch}, "seed": 0}
    )
    train = load_tokens(str(path), block_size=args.block)
    loader, _ = make_loaders(run, None, train, None, (0, 2))  # type: ignore[arg-type]
    return loader


def nanogpt_get_batch(path: Path, block_size: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """nanoGPT's train.py get_batch (CPU): a new memmap per batch to avoid its memory leak."""
    data = np.memmap(path, dtype=np.uint16, mode="r")
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy((data[i : i + block_size]).astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy((data[i + 1 : i + 1 + block_size]).astype(np.int64)) for i in ix])
    return x, y


def loader_rates(path: Path, args: argparse.Namespace) -> tuple[float, float]:
    """Median tokens/s over interleaved rounds of `args.batches` batches: (disttrain, nanoGPT)."""
    ours, theirs = [], []
    batches = iter(disttrain_loader(path, args))
    tokens = args.batches * args.batch * args.block
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        for _ in range(args.batches):
            next(batches)
        ours.append(tokens / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        for _ in range(args.batches):
            nanogpt_get_batch(path, args.block, args.batch)
        theirs.append(tokens / (time.perf_counter() - t0))
    return statistics.median(ours), statistics.median(theirs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps of each CLI run")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batches", type=int, default=200, help="batches per timed round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dense", action="store_true", help="write the 2 GB file (else sparse)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_data_") as tmp:
        folder = Path(tmp)
        t0 = time.perf_counter()
        big, small = make_files(folder, args.dense, args.vocab)
        print(f"files: {big.stat().st_size / 1e9:.2f} GB ({'dense' if args.dense else 'sparse'}) and "
              f"{small.stat().st_size / 1e6:.2f} MB in {time.perf_counter() - t0:.1f} s")  # fmt: skip
        runs = {name: train(path, folder / name, args) for name, path in (("2MB", small), ("2GB", big))}
        print(f"\nRSS peak per rank (MB), {args.steps} steps of model=gpt data=tokens, 2 gloo ranks:")
        for rank in runs["2GB"]["rss_mb"]:
            s, b = runs["2MB"]["rss_mb"].get(rank, 0.0), runs["2GB"]["rss_mb"][rank]
            print(
                f"  rank {rank}: 2 MB file {s:7.1f}   2 GB file {b:7.1f}   difference {b - s:+7.1f} (limit 200)"
            )
        rows = runs["2GB"]["rows"]
        print(f"  2 GB run loss {rows[0]['train/loss']:.3f} (step {rows[0]['step']}) -> "
              f"{rows[-1]['train/loss']:.3f} (step {rows[-1]['step']})")  # fmt: skip
        ours, theirs = loader_rates(big, args)
        print(f"\nloader tokens/s on the 2 GB file, batch {args.batch} x block {args.block}, median of "
              f"{args.rounds} interleaved rounds of {args.batches} batches:")  # fmt: skip
        print(f"  disttrain data=tokens {ours:12,.0f}\n  nanoGPT get_batch     {theirs:12,.0f}\n"
              f"  ratio                 {ours / theirs:12.2f} (target >= 1.0)")  # fmt: skip
        waits = [r["data_wait_frac"] for r in rows[1:]] or [rows[0]["data_wait_frac"]]
        steps = [r["step_time_s"] for r in rows[1:]] or [rows[0]["step_time_s"]]
        print(f"\ndata_wait_frac of a GPT step (2 GB run, log windows after the first): "
              f"mean {statistics.mean(waits):.4f}, max {max(waits):.4f} (target < 0.05); "
              f"step {statistics.median(steps) * 1000:.1f} ms")  # fmt: skip
        print(f"load: {os.getloadavg()[0]:.1f} (1 min) on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
