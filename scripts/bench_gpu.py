"""The built-in gpt on one GPU: disttrain's engine against a bare loop, tokens/s and MFU.

Three runs of the same model, data, batch, bf16 autocast and optimizer (AdamW, foreach, lr 3e-4,
weight decay 0.01), timed the same way (tokens of a 10-step window over its wall time: data
loading, the host-to-device copy and a sync at the window's end included), interleaved repeats,
medians:
- `bare`: a plain loop in its own process (it exits before the next run: its CUDA context and
  cached memory never sit beside disttrain's);
- `disttrain single`: `disttrain train strategy=single` on the same plain module: disttrain's
  engine cost is its ratio to bare;
- `disttrain fsdp`: FSDP2 on one GPU (bf16 parameter casts, hooks): what sharding costs where it
  cannot pay off.
MFU uses disttrain.observe.throughput's peak table and the model's `flops_per_token()`.

    python scripts/bench_gpu.py                     # ~5 min on an H100
    python scripts/bench_gpu.py --dim 1024 --layers 12 --block 512 --batch 16   # launch-bound

The default size keeps an H100 busy: at dim 1024 x 12 layers, context 512, batch 16 the GPU ran
kernels ~15 ms of a ~38 ms bare step (torch.profiler), so all three loops were bound by the host's
kernel launches and Python, and `fsdp / single` (0.39 there) measured FSDP2's per-parameter hook
and DTensor cost on the host, not sharding. Measured 2026-11-25 on one H100 80GB (torch
2.11.0+cu130, the device image's; 16 host cores, nothing else running):

    size (dim x layers, context, batch)   bare tok/s   MFU    single/bare   fsdp/single
    2048 x 16, 1024, 8  (default)             68,560   0.363      1.051         0.908  (1 repeat, 60 steps)
    1024 x 12,  512, 16                      217,117   0.216      0.919         0.394  (median of 2, 120 steps)

Without a CUDA GPU it runs a small fp32 config on the CPU (gloo) to check the script itself: those
numbers are not GPU numbers. A failed run prints its command, its stderr and its ranks' log tails
and keeps its run dir (the path is printed); runs that all succeed leave nothing behind.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

LOG_EVERY = 10  # steps per timed window, in both loops
# No GPU: a config small enough to check the script in a minute or two (fp32: CPU bf16 is emulated).
SMALL_CPU = {
    "dim": 32,
    "layers": 1,
    "heads": 2,
    "block": 32,
    "batch": 4,
    "steps": 20,
    "warmup": 10,
    "repeats": 1,
}


class BenchFailed(RuntimeError):
    """A run failed: the message holds its command, output tails and where its files are kept."""


def tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def run_logged(cmd: list[str], run_dir: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run `cmd`; on failure raise BenchFailed with its stderr/stdout tails and, for a disttrain run,
    the tail of every rank's log in `run_dir` (kept on disk)."""
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode == 0:
        return proc
    parts = [f"`{' '.join(cmd)}` exited {proc.returncode}"]
    parts += [f"--- stderr (tail)\n{tail(proc.stderr)}"] if proc.stderr.strip() else []
    parts += [f"--- stdout (tail)\n{tail(proc.stdout)}"] if proc.stdout.strip() else []
    for log in sorted((run_dir / "logs").glob("*.log")) if run_dir else []:
        parts.append(f"--- {log} (tail)\n{tail(log.read_text(errors='replace'))}")
    if run_dir:
        parts.append(f"run dir kept: {run_dir}")
    raise BenchFailed("\n".join(parts))


def bare_loop(opts: dict[str, Any]) -> dict[str, float]:
    """The same model, data, bf16 autocast and optimizer in a plain loop (run in its own process)."""
    import torch

    from disttrain.data.text import load_text
    from disttrain.models.gpt import GPT
    from disttrain.observe.throughput import device_peak_flops
    from disttrain.tasks import LanguageModel

    torch.manual_seed(0)
    device = torch.device(opts["device"])
    data = load_text(block_size=opts["block"], split="train")
    loader = torch.utils.data.DataLoader(data, batch_size=opts["batch"], shuffle=True, drop_last=True)
    model = GPT(256, opts["block"], dim=opts["dim"], n_layers=opts["layers"], n_heads=opts["heads"])
    model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01, foreach=True)
    task = LanguageModel()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rates, step, started = [], 0, time.perf_counter()
    while step < opts["steps"]:
        for x, y in loader:  # the window's clock runs through data loading and the copy, as disttrain's
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=opts["amp"] == "bf16"):
                loss = task.loss(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % LOG_EVERY == 0:
                loss.item()  # disttrain's log step reads the loss: the same sync
                sync()
                now = time.perf_counter()
                if step > opts["warmup"]:
                    rates.append(LOG_EVERY * opts["batch"] * opts["block"] / (now - started))
                started = now
            if step == opts["steps"]:
                break
    tokens_per_s = statistics.median(rates)
    peak = device_peak_flops(device)
    mfu = tokens_per_s * model.flops_per_token() / peak if peak else float("nan")
    return {"tokens_per_s": tokens_per_s, "mfu": mfu}


def bare(opts: dict[str, Any]) -> dict[str, float]:
    """bare_loop in a child process: its GPU memory is released before the next run starts."""
    proc = run_logged([sys.executable, __file__, "--bare-json", json.dumps(opts)])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def disttrain(opts: dict[str, Any], work: Path, strategy: str = "single") -> dict[str, float]:
    """One `disttrain train` run into a new dir under `work`; its median windowed tokens/s and MFU."""
    run_dir = work / f"{strategy}_{time.time_ns()}"
    gpu = opts["device"] == "cuda"
    cmd = [
        sys.executable, "-m", "disttrain", "train", f"hydra.run.dir={run_dir}", "model=gpt",
        f"strategy={strategy}", f"amp={opts['amp']}", f"backend={'nccl' if gpu else 'gloo'}", "nproc_per_node=1",
        f"data.block_size={opts['block']}", f"model.dim={opts['dim']}", f"model.n_layers={opts['layers']}",
        f"model.n_heads={opts['heads']}", f"trainer.batch_size={opts['batch']}",
        f"trainer.max_steps={opts['steps']}", f"trainer.log_every={LOG_EVERY}", "trainer.val_every=0",
        "trainer.ckpt_every=0", "trainer.progress=false", "optim=adamw", "optim.lr=3e-4",
        "optim.weight_decay=0.01", "+optim.foreach=true", "checkpoint.export_final=false",
    ]  # fmt: skip
    run_logged(cmd, run_dir)
    records = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln]
    steady = [r for r in records if "tokens_per_s" in r and r["step"] > opts["warmup"]]
    return {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
        "mfu": statistics.median(r.get("mfu", float("nan")) for r in steady),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--block", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bare-json", help=argparse.SUPPRESS)  # the child process of bare()
    args = parser.parse_args()
    if args.bare_json:
        print(json.dumps(bare_loop(json.loads(args.bare_json))))
        return
    import torch

    opts = vars(args) | {"device": "cuda", "amp": "bf16"}
    del opts["bare_json"]
    if not torch.cuda.is_available():
        print(
            "bench_gpu: no CUDA GPU here (torch.cuda.is_available() is False): running a small CPU "
            "config to check the script itself; these are not GPU numbers"
        )
        opts |= SMALL_CPU | {"device": "cpu", "amp": "off"}
    rows: dict[str, list[dict[str, float]]] = {"bare": [], "disttrain single": [], "disttrain fsdp": []}
    work = Path(tempfile.mkdtemp(prefix="bench_gpu_"))
    try:
        for _ in range(opts["repeats"]):
            rows["bare"].append(bare(opts))
            rows["disttrain single"].append(disttrain(opts, work, "single"))
            rows["disttrain fsdp"].append(disttrain(opts, work, "fsdp"))
    except BenchFailed as exc:
        sys.exit(f"bench_gpu: a run failed\n{exc}")
    shutil.rmtree(work, ignore_errors=True)  # kept above, where a run failed
    med = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in rows.items()}
    name = torch.cuda.get_device_name() if opts["device"] == "cuda" else "CPU"
    print(
        f"{name} | gpt dim {opts['dim']} x {opts['layers']} layers, context {opts['block']}, "
        f"batch {opts['batch']}, amp {opts['amp']}, AdamW foreach, median of {opts['repeats']}"
    )
    for k, m in med.items():
        print(f"{k:17s} {m['tokens_per_s']:12,.0f} tokens/s  MFU {m['mfu']:.3f}")
    base, single = med["bare"]["tokens_per_s"], med["disttrain single"]["tokens_per_s"]
    print(f"disttrain single / bare loop tokens/s: {single / base:.3f} (the engine's cost)")
    print(f"disttrain fsdp / disttrain single tokens/s: {med['disttrain fsdp']['tokens_per_s'] / single:.3f}")


if __name__ == "__main__":
    main()
