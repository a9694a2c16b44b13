"""peft=lora against a full fine-tune: peak memory of the same training run, side by side.

    python scripts/bench_lora.py [--width 768] [--layers 6] [--rank 8] [--steps 4] [--batch 4]

One invocation, two sides, each in a fresh process (so each peak is that side's alone), on the same
base: a GPT-2 (--width, --layers, vocab 256, 64 positions) written by save_pretrained and loaded by
init.path, trained for --steps optimizer steps of AdamW on data=text under strategy=single, the
final checkpoint saved:

- full: every parameter trains (peft=none): weights, gradients and AdamW's two moments.
- lora: peft=lora peft.rank=--rank on GPT-2's c_attn, c_proj, c_fc: only the adapters train.

Peak memory is the process's peak RSS (ru_maxrss) minus its RSS just before the run started
(torch, transformers and peft imported in both), and on a GPU `torch.cuda.max_memory_allocated`
as well. The last line is the ratio lora / full (the goal: well under 1; the frozen base is the floor).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_init import rss_mb  # scripts/ is on sys.path when this file runs


def side(name: str, base: Path, args: argparse.Namespace, out: Path) -> None:
    """One training run in this process (rank 0 of a world of one), its peak memory into `out`."""
    import peft  # noqa: F401 - imported on both sides: the baseline holds the same libraries
    import torch
    import torch.distributed as dist
    import transformers  # noqa: F401

    from disttrain.config import compose, resolve
    from disttrain.config.run import Run
    from disttrain.dist import DistEnv
    from disttrain.preflight.checks import check_static
    from disttrain.worker import train

    overrides = [
        "nproc_per_node=1",
        "strategy=single",
        "trainer.progress=false",
        "observe.sinks=[]",
        "data=text",
        "task=model_loss",
        "task.call={input_ids: x, labels: x}",
        "model._target_=transformers.AutoModelForCausalLM.from_pretrained",
        f"model.pretrained_model_name_or_path={base}",
        f"init.path={base}",
        f"trainer.max_steps={args.steps}",
        f"trainer.batch_size={args.batch}",
        "trainer.val_batches=1",
        *(["peft=lora", f"peft.rank={args.rank}"] if name == "lora" else []),
    ]
    run = Run.of(resolve(compose(overrides), overrides))
    check_static(run)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1
    )
    before = rss_mb()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as run_dir:
        summary = train(Run.of(run.to_dict()), DistEnv(0, 0, 1, 1, "gloo", device), Path(run_dir))
    took = time.perf_counter() - t0
    result: dict[str, Any] = {
        "side": name,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before,
        "seconds": took,
        "state_bytes": summary.get("state_bytes_per_rank"),
        "trainable": (summary.get("peft") or {}).get("trainable_params"),
    }
    if device.type == "cuda":
        result["cuda_peak_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    dist.destroy_process_group()
    out.write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--side", choices=["full", "lora"], help=argparse.SUPPRESS)
    parser.add_argument("--base", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        side(args.side, Path(args.base), args, Path(args.out))
        return
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        config = GPT2Config(vocab_size=256, n_positions=64, n_embd=args.width, n_layer=args.layers, n_head=12)
        model = GPT2LMHeadModel(config)
        params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(Path(tmp) / "base")
        del model
        results = {}
        for name in ("full", "lora"):
            out = Path(tmp) / f"{name}.json"
            cmd = [
                sys.executable,
                __file__,
                "--side",
                name,
                "--base",
                str(Path(tmp) / "base"),
                "--out",
                str(out),
            ]
            cmd += [f"--{k}={getattr(args, k)}" for k in ("width", "layers", "rank", "steps", "batch")]
            subprocess.run(cmd, check=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
            results[name] = json.loads(out.read_text())
    print(
        f"\nGPT-2 {args.layers} x {args.width}, {params:,} parameters ({params * 4 / 2**20:.0f} MB fp32), "
        f"{args.steps} AdamW steps, batch {args.batch} x 64 tokens, LoRA rank {args.rank}"
    )
    print(f"{'side':6} {'peak RSS (MB)':>14} {'state bytes (MB)':>17} {'trainable':>12} {'seconds':>8}")
    for name, r in results.items():
        trainable = r["trainable"] or params
        print(
            f"{name:6} {r['peak_rss_mb']:14.0f} {r['state_bytes'] / 2**20:17.1f} {trainable:12,} {r['seconds']:8.1f}"
            + (f"   CUDA peak {r['cuda_peak_mb']:.0f} MB" if "cuda_peak_mb" in r else "")
        )
    ratio = results["lora"]["peak_rss_mb"] / results["full"]["peak_rss_mb"]
    print(f"peak RSS lora / full: {ratio:.2f}")
    if "cuda_peak_mb" in results["lora"]:
        print(
            f"CUDA peak lora / full: {results['lora']['cuda_peak_mb'] / results['full']['cuda_peak_mb']:.2f}"
        )


if __name__ == "__main__":
    main()
