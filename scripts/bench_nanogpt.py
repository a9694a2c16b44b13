"""nanoGPT's own training loop under torchrun vs the same model trained through `disttrain train`.

The comparison of docs review 2026-11-28-real-workloads.md, case 1, made repeatable: nanoGPT's
`GPT` (tests/clients/nanogpt/model.py, vendored unmodified) on a character-level `.bin` of uint16
token ids, 2 gloo ranks on CPU, batch 12 x 64 tokens per rank, AdamW (0.9, 0.99) with nanoGPT's
decay groups (every >= 2-D parameter decays 0.1), clipping at 1.0, 100 warm-up steps then cosine
to lr / 10, float32, no dropout.

- bare: this script under `torchrun --standalone`, its `_bare_rank` being nanoGPT's `train.py`
  written out (its essentials, in its order): `get_batch` opens the memmap and stacks
  `torch.randint` windows each call, the next batch is drawn between forward and backward,
  `require_backward_grad_sync` on the last micro-step, the lr set into the groups by hand each
  step, `clip_grad_norm_`, `zero_grad(set_to_none=True)`, `loss.item()` on rank 0 at log steps.
  nanoGPT's own DDP path needs CUDA; this is the review's 3-line CPU patch (`device_ids=None`).
- disttrain: `python -m disttrain train` with the review's overrides from a work dir holding
  `model.py`, `conf/model/nanogpt.yaml` (`_target_: model.GPT`) and the groups factory;
  `data=tokens` on the same `.bin`, `task=model_loss 'task.call={idx: x, targets: y}'`.

Both sides keep torchrun's and disttrain's own thread defaults unless `--threads N` pins them
(torchrun sets OMP_NUM_THREADS=1 per rank when several run; disttrain, cores / local ranks).

Step time is steady state: (time of the last log - time of the first log at or after `--warmup`)
/ steps in between, from rank 0's log stamps (disttrain: metrics.jsonl). CPU per step sums every
process of the run over the same window (/proc); "others busy" is the share of the machine other
processes used meanwhile (a shared machine inflates wall time far more than CPU time). Runs
alternate (bare, disttrain, disttrain, bare, ...); the table holds medians over the repeats.

    python scripts/bench_nanogpt.py                 # 4 repeats x 300 steps, ~6 min on 2 quiet cores
    python scripts/bench_nanogpt.py --repeats 2 --steps 150
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_overhead import BUSY_WARN, CpuSampler  # scripts/ is sys.path[0] when a script runs

ROOT = Path(__file__).resolve().parents[1]
MODEL_PY = ROOT / "tests" / "clients" / "nanogpt" / "model.py"
TEXT = ROOT / "disttrain" / "data" / "text" / "python_reference.txt"
WORLD, TARGET = 2, 1.03
LR, MIN_LR, BETAS, WEIGHT_DECAY, CLIP, WARMUP_ITERS = 1e-3, 1e-4, (0.9, 0.99), 0.1, 1.0, 100

MODEL_YAML = """\
defaults:
  - override /task@_global_.task: model_loss
_target_: model.GPT
config: {_target_: model.GPTConfig, n_layer: %(layers)d, n_head: %(heads)d, n_embd: %(width)d,
         block_size: '${data.block_size}', vocab_size: '${data.num_classes}', dropout: 0.0, bias: false}
"""
GROUPS_PY = '''\
def groups(model, weight_decay: float = 0.1):
    """nanoGPT's configure_optimizers grouping: every >= 2-D parameter decays."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
'''


# ------------------------------------------------------------------------------------ bare side
def _bare_rank(opts: dict[str, Any], out: str) -> None:
    """One rank of nanoGPT's train.py (ddp, device=cpu, dtype=float32, compile=False)."""
    import math
    from contextlib import nullcontext

    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    sys.path.insert(0, opts["work"])
    from model import GPT, GPTConfig  # type: ignore[import-not-found]  # nanoGPT's, as copied there

    if opts["threads"]:
        torch.set_num_threads(opts["threads"])
    dist.init_process_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    master = rank == 0
    accum = opts["accum"] * world
    assert accum % world == 0
    accum //= world
    torch.manual_seed(1337 + rank)
    ctx = nullcontext()  # device_type cpu
    batch_size, block_size, path = opts["batch"], opts["block"], opts["bin"]

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        data = np.memmap(path, dtype=np.uint16, mode="r")  # recreated per batch, as nanoGPT does
        ix = torch.randint(len(data) - block_size, (batch_size,))
        x = torch.stack([torch.from_numpy((data[i : i + block_size]).astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy((data[i + 1 : i + 1 + block_size]).astype(np.int64)) for i in ix])
        return x.to("cpu"), y.to("cpu")

    def get_lr(it: int) -> float:
        if it < WARMUP_ITERS:
            return LR * (it + 1) / (WARMUP_ITERS + 1)
        if it > opts["steps"]:
            return MIN_LR
        decay_ratio = (it - WARMUP_ITERS) / (opts["steps"] - WARMUP_ITERS)
        return MIN_LR + 0.5 * (1.0 + math.cos(math.pi * decay_ratio)) * (LR - MIN_LR)

    conf = GPTConfig(
        n_layer=opts["layers"], n_head=opts["heads"], n_embd=opts["width"], block_size=block_size,
        vocab_size=opts["vocab"], dropout=0.0, bias=False,
    )  # fmt: skip
    model = GPT(conf).to("cpu")
    optimizer = model.configure_optimizers(WEIGHT_DECAY, LR, BETAS, "cpu")
    model = DDP(model, device_ids=None)
    records: list[dict[str, float]] = []
    first_step_at = 0.0
    X, Y = get_batch()
    iter_num = 1  # counted as disttrain counts: step n is the n-th optimizer step done
    while True:
        lr = get_lr(iter_num - 1)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        for micro_step in range(accum):
            model.require_backward_grad_sync = micro_step == accum - 1
            with ctx:
                _logits, loss = model(X, Y)
                loss = loss / accum
            X, Y = get_batch()
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        first_step_at = first_step_at or time.time()
        if iter_num % opts["log_every"] == 0 and master:
            records.append({"step": iter_num, "time": time.time(), "loss": loss.item() * accum})
        if iter_num >= opts["steps"]:
            break
        iter_num += 1
    if master:
        Path(out).write_text(json.dumps({"first_step_at": first_step_at, "records": records}))
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------ parent side
def prepare(work: Path, opts: dict[str, Any]) -> None:
    """nanoGPT's shakespeare_char prepare.py on disttrain's shipped text: a char vocabulary, the
    first 90 % as train.bin, the rest val.bin (uint16); model.py and the disttrain config beside."""
    import numpy as np

    text = TEXT.read_text(encoding="utf-8")
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    ids = np.array([index[c] for c in text], dtype=np.uint16)
    cut = int(len(ids) * 0.9)
    ids[:cut].tofile(work / "train.bin")
    ids[cut:].tofile(work / "val.bin")
    opts["vocab"] = len(chars)
    shutil.copy(MODEL_PY, work / "model.py")
    (work / "conf" / "model").mkdir(parents=True)
    (work / "conf" / "model" / "nanogpt.yaml").write_text(MODEL_YAML % opts)
    (work / "nanogpt_groups.py").write_text(GROUPS_PY)


def disttrain_command(opts: dict[str, Any], run_dir: Path) -> list[str]:
    """The review's command (case 1), with no validation or checkpoint inside the timed steps."""
    overrides = [
        f"hydra.run.dir={run_dir}", "model=nanogpt", "data=tokens",
        f"data.path={opts['bin']}", f"data.val_path={opts['val_bin']}", f"data.num_classes={opts['vocab']}",
        f"data.block_size={opts['block']}", f"trainer.batch_size={opts['batch']}",
        f"trainer.grad_accum={opts['accum']}", f"trainer.max_steps={opts['steps']}",
        "task.call={idx: x, targets: y}", "task.tokens=idx", f"optim.lr={LR}",
        f"optim.betas=[{BETAS[0]},{BETAS[1]}]", "optim.param_groups._target_=nanogpt_groups.groups",
        f"optim.param_groups.weight_decay={WEIGHT_DECAY}", f"sched.warmup_steps={WARMUP_ITERS}",
        f"sched.min_lr_ratio={MIN_LR / LR}", f"trainer.clip_grad_norm={CLIP}", "trainer.val_batches=10",
        f"trainer.log_every={opts['log_every']}", "trainer.val_every=0", "trainer.ckpt_every=0",
        "strategy=ddp", "backend=gloo", f"nproc_per_node={WORLD}", "launcher=torchrun",
        "trainer.progress=false", "checkpoint.export_final=false",
    ]  # fmt: skip
    if opts["threads"]:
        overrides.append(f"threads_per_rank={opts['threads']}")
    return [sys.executable, "-m", "disttrain", "train", "--config-dir", "conf", *overrides]


def bare_command(opts: dict[str, Any], out: Path) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}",
        __file__, "--worker", "--out", str(out), "--opts", json.dumps(opts),
    ]  # fmt: skip


def run_once(kind: str, opts: dict[str, Any], work: Path, tag: str) -> dict[str, float]:
    target = work / f"{kind}_{tag}"
    cmd = disttrain_command(opts, target) if kind == "disttrain" else bare_command(opts, target)
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)  # each side's own default (torchrun: 1 per rank)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    log_path = work / f"{kind}_{tag}.out"
    with CpuSampler() as cpu, log_path.open("w") as log:
        launched = time.time()
        proc = subprocess.run(cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"{kind} exited {proc.returncode}: {log_path.read_text()[-3000:]}")
    if kind == "disttrain":
        lines = (target / "metrics.jsonl").read_text().splitlines()
        records = [json.loads(ln) for ln in lines if ln]
        records = [
            {"step": r["step"], "time": r["time"], "loss": r["train/loss"]}
            for r in records
            if "step_time_s" in r
        ]
        first = json.loads((target / "summary.json").read_text())["first_step_at"]
    else:
        result = json.loads(target.read_text())
        records, first = result["records"], result["first_step_at"]
    steady = [r for r in records if r["step"] >= opts["warmup"]]
    a, b = steady[0], steady[-1]
    steps = b["step"] - a["step"]
    row = {
        "step_ms": 1e3 * (b["time"] - a["time"]) / steps,
        "first_step_s": first - launched,
        "loss": b["loss"],
        "cpu_ms": float("nan"),
        "others": float("nan"),
    }
    window = cpu.window(a["time"], b["time"])
    if window is not None:
        row["cpu_ms"], row["others"] = 1e3 * window[0] / steps, window[1]
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--repeats", type=int, default=4, help="interleaved runs of each side (default 4)")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps per run (default 300)")
    p.add_argument("--warmup", type=int, default=50, help="steps before timing starts (default 50)")
    p.add_argument("--log-every", type=int, default=10, help="steps between logs (default 10, the review's)")
    p.add_argument("--batch", type=int, default=12, help="sequences per rank per micro-step (default 12)")
    p.add_argument("--accum", type=int, default=1, help="micro-steps per rank per step (default 1)")
    p.add_argument("--block", type=int, default=64, help="tokens per sequence (default 64)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--threads", type=int, default=0, help="intra-op threads per rank; 0: each side's default")
    p.add_argument("--keep", action="store_true", help="keep the work dir (printed)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--opts", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _bare_rank(json.loads(args.opts), args.out)
        return 0
    if args.steps - args.warmup < 2 * args.log_every:
        p.error("--steps must leave at least two log windows after --warmup")
    work = Path(tempfile.mkdtemp(prefix="bench_nanogpt_"))
    opts: dict[str, Any] = {
        "steps": args.steps, "warmup": args.warmup, "log_every": args.log_every, "batch": args.batch,
        "accum": args.accum, "block": args.block, "layers": args.layers, "heads": args.heads,
        "width": args.width, "threads": args.threads, "work": str(work),
        "bin": str(work / "train.bin"), "val_bin": str(work / "val.bin"),
    }  # fmt: skip
    prepare(work, opts)
    load = os.getloadavg()
    results: dict[str, list[dict[str, float]]] = {"bare": [], "disttrain": []}
    try:
        for r in range(args.repeats):
            for kind in ("bare", "disttrain") if r % 2 == 0 else ("disttrain", "bare"):
                row = run_once(kind, opts, work, str(r))
                results[kind].append(row)
                print(
                    f"repeat {r + 1}/{args.repeats} {kind:9s} step {row['step_ms']:7.2f} ms, cpu "
                    f"{row['cpu_ms']:7.2f} ms, first step {row['first_step_s']:5.2f} s, others busy "
                    f"{row['others']:.0%}, load {os.getloadavg()[0]:.2f}",
                    flush=True,
                )
    finally:
        if args.keep:
            print(f"work dir kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    report(args, opts, results, load)
    return 0


def report(
    args: argparse.Namespace, opts: dict[str, Any], results: dict[str, list[dict[str, float]]], load: Any
) -> None:
    bare, ours = results["bare"], results["disttrain"]
    tokens = WORLD * args.batch * args.accum * args.block
    threads = f"{args.threads} thread(s)" if args.threads else "default threads"
    print(
        f"\nnanoGPT GPT {args.layers}x{args.width} ({args.heads} heads), vocab {opts['vocab']}, {WORLD} gloo "
        f"ranks x {threads}, {tokens} tokens/step, {args.steps} steps (timed from {args.warmup}), "
        f"median of {args.repeats} interleaved repeats; load average before {load[0]:.2f} {load[1]:.2f} "
        f"{load[2]:.2f}, after {os.getloadavg()[0]:.2f}\n"
    )
    print(f"{'':34}{'bare':>11}{'disttrain':>11}{'ratio':>8}")
    for name, key, fmt in (
        ("step time, steady state (ms)", "step_ms", ".2f"),
        ("tokens/s", None, ".0f"),
        ("CPU per step, all processes (ms)", "cpu_ms", ".2f"),
        ("launch -> first step done (s)", "first_step_s", ".2f"),
        ("other processes' share of the CPUs", "others", ".0%"),
        ("train loss at the last log", "loss", ".4f"),
    ):
        if key is None:
            x = tokens / statistics.median(r["step_ms"] for r in bare) * 1e3
            y = tokens / statistics.median(r["step_ms"] for r in ours) * 1e3
        else:
            x, y = statistics.median(r[key] for r in bare), statistics.median(r[key] for r in ours)
        ratio = f"{y / x:8.3f}" if key not in ("first_step_s", "others", "loss") else ""
        print(f"{name:34}{x:>11{fmt}}{y:>11{fmt}}{ratio}")
    pairs = [b["step_ms"] and d["step_ms"] / b["step_ms"] for b, d in zip(bare, ours, strict=True)]
    ratio = statistics.median(r["step_ms"] for r in ours) / statistics.median(r["step_ms"] for r in bare)
    busy = max(r["others"] for r in bare + ours)
    note = f" (others kept up to {busy:.0%} of the CPUs busy: noisy)" if busy > BUSY_WARN else ""
    print(f"\nper-pair step ratios: {', '.join(f'{x:.3f}' for x in pairs)}")
    verdict = "OK" if ratio <= TARGET else "ABOVE TARGET"
    print(f"step-time ratio disttrain/bare = {ratio:.3f} (target <= {TARGET}): {verdict}{note}")


if __name__ == "__main__":
    raise SystemExit(main())
