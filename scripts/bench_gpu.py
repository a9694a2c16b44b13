"""The built-in gpt under fsdp + bf16 on one GPU: tokens/s and MFU against the GPU's peak.

Runs `disttrain train model=gpt strategy=fsdp amp=bf16` on one CUDA device (nccl) with a model big
enough to keep the GPU busy (default: dim 1024, 12 layers, context 512 on the shipped byte corpus)
and a bare single-GPU loop of the same model, batch and precision side by side (interleaved
repeats, medians), so the ratio shows what disttrain's engine costs on a GPU. MFU uses
disttrain.observe.throughput's peak table (dense bf16 data-sheet FLOP/s) and the model's own
`flops_per_token()` (6 N + attention, as in PaLM's appendix B).

    python scripts/bench_gpu.py                     # ~3 min on an H100
    python scripts/bench_gpu.py --dim 2048 --layers 24 --batch 8

Without a CUDA GPU it says so and exits 0 (the CPU machines that run CI have none).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def bare(opts: dict[str, Any]) -> dict[str, float]:
    """The same model, data and bf16 autocast in a plain loop (no DDP: one GPU)."""
    import torch

    from disttrain.data.text import load_text
    from disttrain.models.gpt import GPT
    from disttrain.observe.throughput import device_peak_flops
    from disttrain.tasks import LanguageModel

    torch.manual_seed(0)
    device = torch.device("cuda")
    data = load_text(block_size=opts["block"], split="train")
    loader = torch.utils.data.DataLoader(data, batch_size=opts["batch"], shuffle=True, drop_last=True)
    model = GPT(256, opts["block"], dim=opts["dim"], n_layers=opts["layers"], n_heads=opts["heads"]).to(
        device
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    task = LanguageModel()
    times, step = [], 0
    while step < opts["steps"]:
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            start = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = task.loss(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            step += 1
            if step == opts["steps"]:
                break
    steady = statistics.median(times[opts["warmup"] :])
    tokens_per_s = opts["batch"] * opts["block"] / steady
    peak = device_peak_flops(device)
    mfu = tokens_per_s * model.flops_per_token() / peak if peak else float("nan")
    return {"tokens_per_s": tokens_per_s, "mfu": mfu}


def disttrain(opts: dict[str, Any], work: Path) -> dict[str, float]:
    run_dir = work / f"run_{time.time_ns()}"
    cmd = [
        sys.executable, "-m", "disttrain", "train", f"hydra.run.dir={run_dir}", "model=gpt",
        "strategy=fsdp", "amp=bf16", "backend=nccl", "nproc_per_node=1", f"data.block_size={opts['block']}",
        f"model.dim={opts['dim']}", f"model.n_layers={opts['layers']}", f"model.n_heads={opts['heads']}",
        f"trainer.batch_size={opts['batch']}", f"trainer.max_steps={opts['steps']}", "trainer.log_every=10",
        "trainer.val_every=0", "trainer.ckpt_every=0", "trainer.progress=false", "optim.lr=3e-4",
        "checkpoint.export_final=false",
    ]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, text=True)
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
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--block", type=int, default=512)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print(
            "bench_gpu: no CUDA GPU on this machine (torch.cuda.is_available() is False); nothing to measure"
        )
        return
    opts = vars(args)
    rows: dict[str, list[dict[str, float]]] = {"bare": [], "disttrain": []}
    with tempfile.TemporaryDirectory(prefix="bench_gpu_") as tmp:
        for _ in range(args.repeats):
            rows["bare"].append(bare(opts))
            rows["disttrain"].append(disttrain(opts, Path(tmp)))
    med = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in rows.items()}
    print(
        f"{torch.cuda.get_device_name()} | gpt dim {args.dim} x {args.layers} layers, context {args.block}, batch {args.batch}, bf16"
    )
    for k, m in med.items():
        print(f"{k:10s} {m['tokens_per_s']:12,.0f} tokens/s  MFU {m['mfu']:.3f}")
    ratio = med["disttrain"]["tokens_per_s"] / med["bare"]["tokens_per_s"]
    print(f"disttrain (fsdp, 1 GPU) / bare loop tokens/s: {ratio:.3f}")


if __name__ == "__main__":
    main()
