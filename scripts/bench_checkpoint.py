"""Checkpoint throughput: disttrain's DCP save/load (sync and async) vs plain torch.save/torch.load.

    python scripts/bench_checkpoint.py [--mb 256] [--repeats 3] [--dir /tmp]

One process, the same state (an MLP's params + AdamW state, about --mb MiB), the same disk.
Reports MB/s for each path and, for async saves, the training stall: the time `save()` blocks
before the step can continue (staging to CPU memory), while the write finishes in the background.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

from disttrain import checkpoint
from disttrain.engine.rng import rng_state

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")


def build(mb: int) -> tuple[nn.Module, torch.optim.Optimizer, float]:
    width = 2048
    layers = max(1, int(mb * 2**20 / 4 / 3 / (width * width)))  # params + 2 Adam moments, fp32
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    size = sum(t.numel() * t.element_size() for t in _tensors({"m": msd, "o": osd})) / 2**20
    return model, opt, size


def _tensors(obj: Any) -> list[torch.Tensor]:
    if torch.is_tensor(obj):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in _tensors(v)]
    return []


def timed(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--verify", default="size", choices=["size", "hash"])
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench_ckpt_", dir=args.dir))
    model, opt, mb = build(args.mb)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    step = [0]

    def dcp_save(async_save: bool) -> tuple[float, float]:
        step[0] += 1
        t0 = time.perf_counter()
        pending = checkpoint.save(
            root / "dcp", step[0], state, rng_state(), {"step": step[0]}, rank=0, keep=1,
            verify=args.verify, async_save=async_save,
        )  # fmt: skip
        stall = time.perf_counter() - t0
        pending.wait()
        return stall, time.perf_counter() - t0

    def plain_save() -> None:
        checkpoint.save_atomic({"model": model.state_dict(), "optim": opt.state_dict()}, root / "plain.pt")

    def dcp_load() -> None:
        path = checkpoint.choose(root / "dcp", args.verify)
        assert path is not None
        checkpoint.load_sharded(path, state, rank=0, no_dist=True)

    def plain_load() -> None:
        checkpoint.load(root / "plain.pt")

    dcp_save(False)  # warm-up: imports, page cache
    plain_save()
    sync = [dcp_save(False) for _ in range(args.repeats)]
    asyn = [dcp_save(True) for _ in range(args.repeats)]
    t_plain_save = timed(plain_save, args.repeats)
    t_dcp_load = timed(dcp_load, args.repeats)
    t_plain_load = timed(plain_load, args.repeats)
    t_sync = statistics.median(t for _, t in sync)
    t_async = statistics.median(t for _, t in asyn)
    stall = statistics.median(s for s, _ in asyn)
    rows = [
        ("torch.save (atomic, fsync)", mb / t_plain_save, t_plain_save),
        (f"DCP save, sync (verify={args.verify})", mb / t_sync, t_sync),
        (f"DCP save, async (verify={args.verify})", mb / t_async, t_async),
        ("torch.load (weights_only)", mb / t_plain_load, t_plain_load),
        (f"DCP load (+ verify={args.verify})", mb / t_dcp_load, t_dcp_load),
    ]
    print(f"state: {mb:.0f} MiB (params + AdamW moments), {args.repeats} repeats, median; dir {root}")
    for name, rate, t in rows:
        print(f"  {name:<36} {rate:8.0f} MiB/s  {t:7.3f} s")
    print(f"  async save: training stalls {stall:.3f} s per save ({stall / t_sync:.0%} of a sync save)")
    print(
        f"  ratios vs torch: DCP sync save x{t_plain_save / t_sync:.2f} speed, load x{t_plain_load / t_dcp_load:.2f}"
    )
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
