"""Checkpoint throughput: disttrain's DCP save/load (sync and async) vs plain torch.save/torch.load.

    python scripts/bench_checkpoint.py [--mb 160] [--repeats 5] [--dir RUN_DIR_DISK] [--cold]
    PYTHONPATH=/path/to/older/checkout python scripts/bench_checkpoint.py   # the "before" numbers

One process, the same state (an MLP's params + AdamW moments, about --mb MiB), the same disk
(--dir: on the run dirs' disk; default runs/, where `disttrain train` puts them). Each repeat runs every
case once, in turn (interleaved), and the table shows medians. Issue 16's targets: DCP save and
load >= 0.9x torch.save / torch.load MB/s; an async save stalls training <= 10 % of a sync save.

What each side does, so that the comparison is fair:
- torch.save: `checkpoint.save_atomic` (temp file, fsync, rename, directory fsync) of
  model.state_dict() + optimizer.state_dict(); it replaces the previous file (freeing it).
- DCP save: what the engine's Checkpointer does: get_state_dict, then `checkpoint.save` (every
  file fsynced, xxh3_64 of every file with verify=hash (summed as DCP writes each buffer: no second
  read), manifest, atomic rename, `latest`, keep=1
  so the previous checkpoint is deleted, as the torch.save side replaces its file).
- async: as the engine: `checkpoint.save(async_save=True, overlap_staging=True)` returns while DCP's
  staging thread copies the state; one forward/backward of the model (--batch rows: the next
  step, which the copy overlaps) runs; then `wait_staged()` (the engine's wait before the optimizer
  update). The stall is the time until save returns plus that wait; the write runs in the
  background and is waited for before the next case.
- torch.load: `checkpoint.load` (weights_only) of the file: no integrity check at all, and the
  tensors are new ones; "+ load_state_dict" copies them into the live model and optimizer, the
  state a DCP load leaves (the verdict uses plain torch.load, the stricter baseline).
- DCP load: what a resume does: `checkpoint.choose` (manifest and sizes) and
  `checkpoint.load_sharded` into the live state dict, which with verify=hash checks every file's
  checksum in the pass that reads it (a mismatch fails the load: the engine falls back). The
  checksum is the one the manifest names, printed in the header: xxh3_64 for manifests written now
  (zlib.crc32 before it, sha256 before that: an older checkout's "before" run shows its own).
CPU seconds (all threads) are printed too: on a busy machine wall times measure the queue for
the cores more than the work. Loads read files just written: warm page cache, unless --cold (posix_fadvise DONTNEED on both
sides' files before each load: evicts only those files' pages; the disk or host cache serves them).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

from disttrain import checkpoint
from disttrain.rng import rng_state

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")

SAVE_TARGET, STALL_TARGET = 0.9, 0.10


def build(mb: int) -> tuple[nn.Module, torch.optim.Optimizer, float]:
    """A transformer-like stack of Linear layers (1024 wide, 4x MLP) with AdamW state: params
    plus two fp32 moments come to about `mb` MiB."""
    width, per_block = 1024, 2 * 4 * 1024 * 1024 + 5 * 1024
    blocks = max(1, round(mb * 2**20 / 12 / per_block))
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)]
    model = nn.Sequential(*layers)
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


def evict(paths: list[Path]) -> None:
    """Drop these files' clean pages from the page cache (not the whole machine's)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def hashed_with(path: Path) -> str:
    """The checksum a committed checkpoint's manifest records (what verify=hash checks)."""
    try:
        entry = json.loads((path / "manifest.json").read_text())["files"][".metadata"]
        return next((k for k in entry if k != "size"), "none (sizes only)")
    except (OSError, ValueError, KeyError, TypeError):
        return "n/a"


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mb", type=int, default=160, help="state size in MiB (params + AdamW moments)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--dir", default="runs", help="a folder on the run dirs' disk (default: runs/, theirs)"
    )
    parser.add_argument("--cold", action="store_true", help="evict the files' pages before each load")
    parser.add_argument(
        "--batch", type=int, default=32, help="rows of the forward/backward an async save's staging overlaps"
    )
    args = parser.parse_args()
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="bench_ckpt_", dir=args.dir))
    model, opt, mb = build(args.mb)
    step = [0]
    ckpts = root / "dcp"
    plain = root / "plain.pt"

    overlap = "overlap_staging" in inspect.signature(checkpoint.save).parameters
    batch = torch.randn(args.batch, 1024)

    def next_step() -> float:
        """The next training step's forward and backward: what the staging copy overlaps."""
        t0 = time.perf_counter()
        model(batch).sum().backward()
        return time.perf_counter() - t0

    def dcp_save(async_save: bool) -> tuple[float, float]:
        step[0] += 1
        t0, c0 = time.perf_counter(), time.process_time()
        msd, osd = get_state_dict(model, opt)
        extra = {"overlap_staging": True} if async_save and overlap else {}
        pending = checkpoint.save(
            ckpts, step[0], {"model": msd, "optim": osd}, rng_state(), {"step": step[0]}, rank=0, keep=1,
            verify="hash", async_save=async_save, **extra,
        )  # fmt: skip
        stall = time.perf_counter() - t0
        if async_save:  # as the engine: the next forward/backward runs, then the update waits for staging
            fwd_bwd.append(next_step())
            t1 = time.perf_counter()
            if extra:
                pending.wait_staged()
            stall += time.perf_counter() - t1
        pending.wait()
        cpu_s.setdefault(f"dcp_save_{async_save}", []).append(time.process_time() - c0)
        return stall, time.perf_counter() - t0

    def plain_save() -> None:
        checkpoint.save_atomic({"model": model.state_dict(), "optim": opt.state_dict()}, plain)

    def dcp_load(verify: str) -> Callable[[], None]:
        def run() -> None:  # named per verify mode below, for the CPU-time table
            msd, osd = get_state_dict(model, opt)
            state = {"model": msd, "optim": osd}
            if "verify" in inspect.signature(checkpoint.load_sharded).parameters:
                path = checkpoint.choose(ckpts, "size")  # as the engine: sizes, then hashes while loading
                assert path is not None
                checkpoint.load_sharded(path, state, rank=0, no_dist=True, verify=verify)
            else:  # an older disttrain (a before/after run): hashes first, then the load
                path = checkpoint.choose(ckpts, verify)
                assert path is not None
                checkpoint.load_sharded(path, state, rank=0, no_dist=True)

        run.__name__ = f"dcp_load_{verify}"
        return run

    def plain_load() -> None:
        checkpoint.load(plain)

    def plain_resume() -> None:  # torch.load's result copied into the live model and optimizer
        state = checkpoint.load(plain)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])

    def timed(fn: Callable[[], Any], cold: list[Path] | None = None) -> float:
        if cold is not None and args.cold:
            evict(cold)
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        cpu_s.setdefault(fn.__name__, []).append(time.process_time() - c0)
        return time.perf_counter() - t0

    cpu_s: dict[str, list[float]] = {}  # process CPU seconds (all threads) per case
    fwd_bwd: list[float] = []  # the overlapped step's forward/backward, seconds
    load_before = loadavg()
    algo = "n/a"
    times: dict[str, list[float]] = {k: [] for k in ("ts", "ds", "da", "stall", "tl", "tr", "dl", "dls")}
    try:
        for r in range(args.repeats + 1):  # round 0 warms up (imports, allocator, page cache)
            if r == 1:
                cpu_s.clear()  # the warm-up round's CPU times are not reported
            ts = timed(plain_save)
            ds = dcp_save(False)[1]
            stall, da = dcp_save(True)
            dcp_files = [p for p in checkpoint.committed(ckpts)[-1].iterdir()]
            algo = hashed_with(checkpoint.committed(ckpts)[-1])
            tl = timed(plain_load, [plain])
            tr = timed(plain_resume, [plain])
            dl = timed(dcp_load("hash"), dcp_files)
            dls = timed(dcp_load("size"), dcp_files)
            if r:
                for k, v in zip(times, (ts, ds, da, stall, tl, tr, dl, dls), strict=True):
                    times[k].append(v)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}

    print(
        f"state {mb:.0f} MiB (params + AdamW moments), {args.repeats} interleaved repeats, medians; "
        f"disk of {Path(args.dir).resolve()}; loads {'cold (files evicted)' if args.cold else 'warm page cache'}; "
        f"loadavg {load_before} -> {loadavg()}; verify=hash checksum: {algo}"
    )
    rows = [
        ("torch.save (fsync + rename)", "ts", "plain_save"),
        ("DCP save, sync, verify=hash", "ds", "dcp_save_False"),
        ("DCP save, async (total, + next step)", "da", "dcp_save_True"),
        ("torch.load (weights_only, no check)", "tl", "plain_load"),
        ("torch.load + load_state_dict", "tr", "plain_resume"),
        ("DCP load + verify=hash", "dl", "dcp_load_hash"),
        ("DCP load + verify=size", "dls", "dcp_load_size"),
    ]
    print(f"  {'':<38} {'MiB/s':>8}  {'wall s':>7}  {'range s':>13}  cpu s (process, all threads)")
    for name, k, c in rows:
        spread = f"{min(times[k]):.3f}-{max(times[k]):.3f}"
        cpu = statistics.median(cpu_s[c])
        print(f"  {name:<38} {mb / med[k]:8.0f}  {med[k]:7.3f}  {spread:>13}  {cpu:.3f}")
    save_ratio = med["ts"] / med["ds"]
    load_ratio = med["tl"] / med["dl"]
    load_ratio_size = med["tl"] / med["dls"]
    stall = med["stall"] / med["ds"]
    ok = lambda good: "PASS" if good else "FAIL"  # noqa: E731
    print(
        f"  async save stall {med['stall']:.3f} s (range {min(times['stall']):.3f}-{max(times['stall']):.3f}):"
        f" until save() returns + the wait for staging after the next step's forward/backward"
        f" (batch {args.batch}, median {statistics.median(fwd_bwd):.3f} s"
        f"{'' if overlap else '; this disttrain stages before returning'})"
    )
    print("verdict (issue 16 targets):")
    print(
        f"  DCP save / torch.save MB/s  {save_ratio:5.2f}  (>= {SAVE_TARGET})  {ok(save_ratio >= SAVE_TARGET)}"
    )
    print(
        f"  DCP load / torch.load MB/s  {load_ratio:5.2f}  (>= {SAVE_TARGET})  {ok(load_ratio >= SAVE_TARGET)}"
    )
    print(
        f"    (with verify=size: {load_ratio_size:.2f}; against torch.load + load_state_dict, which like"
        f" DCP leaves the state in the live tensors: {med['tr'] / med['dl']:.2f} hash, {med['tr'] / med['dls']:.2f} size)"
    )
    print(f"  async stall / sync save     {stall:5.1%}  (<= {STALL_TARGET:.0%})  {ok(stall <= STALL_TARGET)}")
    cpu = {k: statistics.median(v) for k, v in cpu_s.items()}
    print(
        "  by CPU seconds (what a busy machine's wall times hide; DCP's load and save use 2 threads):"
        f" save {cpu['plain_save'] / cpu['dcp_save_False']:.2f},"
        f" load hash {cpu['plain_load'] / cpu['dcp_load_hash']:.2f}, load size {cpu['plain_load'] / cpu['dcp_load_size']:.2f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
