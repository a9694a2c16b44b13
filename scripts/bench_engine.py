"""GPT step time on CPU: amp off vs bf16, and torch.compile off vs on, as ratios.

Trains the built-in GPT (disttrain.models.gpt) on the shipped text in this process, one rank, no
launcher, through the same Precision object the engine uses: forward under autocast, CE per token,
backward, clip, AdamW. Each variant: `--warmup` steps (compilation happens here), then the median
of `--steps` timed steps. Prints seconds per step and ratios against amp=off, compile=off.

    python scripts/bench_engine.py              # ~2 min on 2 cores (compile dominates)
    python scripts/bench_engine.py --quick
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from disttrain.data.text import load_text
from disttrain.models.gpt import GPT
from disttrain.strategies.precision import Precision
from disttrain.tasks import LanguageModel


def time_variant(amp: str, compile_: bool, args: argparse.Namespace) -> float:
    torch.manual_seed(0)
    model = GPT(block_size=args.block, dim=args.dim, n_layers=args.layers, n_heads=4)
    if compile_:
        model.compile()
    dtype = {"off": "float32", "bf16": "bfloat16"}[amp]
    prec = Precision({"name": amp, "dtype": dtype}, torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    task = LanguageModel()
    data = load_text(block_size=args.block)
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch, shuffle=True, drop_last=True)
    batches = iter(loader)
    times = []
    for i in range(args.warmup + args.steps):
        x, y = next(batches)
        t0 = time.perf_counter()
        with prec.autocast():
            loss = task.loss(model(x), y)
        prec.scale(loss).backward()
        prec.unscale(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        prec.step(opt)
        opt.zero_grad(set_to_none=True)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="a smaller model and fewer steps")
    args = ap.parse_args()
    if args.quick:
        args.dim, args.layers, args.block, args.steps, args.warmup = 64, 2, 64, 10, 3
    torch.set_num_threads(args.threads)
    rows = {}
    for amp in ("off", "bf16"):
        for compile_ in (False, True):
            rows[(amp, compile_)] = time_variant(amp, compile_, args)
    base = rows[("off", False)]
    print(
        f"gpt dim={args.dim} layers={args.layers} block={args.block} batch={args.batch}, CPU, {args.threads} threads"
    )
    print(f"{'amp':<6}{'compile':<9}{'s/step':>10}{'vs off/eager':>14}")
    for (amp, compile_), t in rows.items():
        print(f"{amp:<6}{str(compile_).lower():<9}{t:>10.4f}{t / base:>13.2f}x")


if __name__ == "__main__":
    main()
