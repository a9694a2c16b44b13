"""The built-in gpt on the GPUs: disttrain's engine against a bare loop, and the speed options, in
tokens/s and MFU.

Every row trains the same model, data, batch and optimizer (AdamW, lr 3e-4, weight decay 0.01; fused
on CUDA: disttrain's `optim.fused=auto`, and the bare loop's `fused=True`), timed the same way: the
tokens of each 10-step window over its wall time, the window closed after the device finished its
queued work (the bare loop synchronizes; disttrain's windows end after the log step's loss `.item()`
since issue 34), data loading and the host-to-device copy included; the median window of a run,
the median over repeats. Rows (ROWS; `--rows` picks some):
- `bare`: a plain loop in its own process (its CUDA context and cached memory are gone before the
  next run starts), bf16 autocast;
- `single`: `disttrain train strategy=single amp=bf16`: its ratio to bare is the engine's cost;
- `regional compile`, `selective AC`, `fp8`: `single` with `trainer.compile=regional`,
  `trainer.activation_checkpointing=selective`, `amp=fp8` (each its own config override);
- `fsdp`: FSDP2 across every GPU of the machine (`nproc_per_node=GPUs`, the same batch per rank:
  its tokens/s per GPU against `single`); on a machine with one GPU, FSDP on one rank, which
  measures FSDP's fixed costs, not sharding.
A row whose run is refused or fails (an option this disttrain lacks, fp8 below compute capability
8.9) prints why and keeps its run dir; the other rows go on. MFU uses disttrain.observe.throughput's
peak table (bf16 dense: fp8's MFU is against the bf16 peak) and the model's `flops_per_token()`.

Each disttrain run writes a final checkpoint (~16 GB at the default size: fp32 weights + AdamW);
its run dir is deleted as soon as its numbers are read, so one run dir exists at a time.

    python scripts/bench_gpu.py                                  # every row, ~1B gpt
    python scripts/bench_gpu.py --rows single fp8 --steps 200    # fp8 vs bf16, the loss at step 200
    python scripts/bench_gpu.py --dim 1024 --layers 12 --block 512 --batch 16   # launch-bound

The default is a ~1B gpt: dim 2048 x 20 layers (1.01 B parameters), context 2048, batch 8 (16k
tokens per step). Earlier measurements, on one H100 80GB (torch 2.11.0+cu130, the device image's;
16 host cores, nothing else running), before issue 34 (windows then closed before the drain, which
flattered disttrain's rows by up to 1/10):

    size (dim x layers, context, batch)   bare tok/s   MFU    single/bare   fsdp/single
    2048 x 16, 1024, 8                        68,560   0.363      1.051         0.908  (1 repeat, 60 steps)
    1024 x 12,  512, 16                      217,117   0.216      0.919         0.394  (median of 2, 120 steps)

Without a CUDA GPU it runs a small fp32 config on the CPU (gloo) to check the script itself: those
numbers are not GPU numbers, and unless `--rows` says otherwise it leaves out fp8 (refused below
compute capability 8.9) and regional compile (minutes of inductor's CPU code). A failed run prints
its command, its stderr and its ranks' log tails and keeps its run dir (the path is printed).
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
# row -> what its disttrain run adds to the common command (None: the bare loop; "fsdp" is placed
# across the machine's GPUs by `fsdp_overrides`)
ROWS: dict[str, tuple[str, ...] | None] = {
    "bare": None,
    "single": (),
    "regional compile": ("trainer.compile=regional",),
    "selective AC": ("trainer.activation_checkpointing=selective",),
    "fp8": ("amp=fp8",),
    "fsdp": ("strategy=fsdp",),
}
# Without a GPU (the script checking itself): see the module's docstring
CPU_ROWS = ["bare", "single", "selective AC", "fsdp"]
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
    fused = device.type == "cuda"  # disttrain's optim.fused=auto
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01, fused=fused or None)
    task = LanguageModel()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rates, step, started, last = [], 0, time.perf_counter(), float("nan")
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
                last = loss.item()  # disttrain's log step reads the loss: the same sync
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
    return {"tokens_per_s": tokens_per_s, "mfu": mfu, "loss": last}


def bare(opts: dict[str, Any]) -> dict[str, float]:
    """bare_loop in a child process: its GPU memory is released before the next run starts."""
    proc = run_logged([sys.executable, __file__, "--bare-json", json.dumps(opts)])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def fsdp_overrides(gpus: int) -> tuple[str, ...]:
    """FSDP across every GPU (the same batch per rank); one rank where there is one GPU or none."""
    return (*(ROWS["fsdp"] or ()), f"nproc_per_node={max(gpus, 1)}")


def command(opts: dict[str, Any], run_dir: Path, overrides: tuple[str, ...]) -> list[str]:
    """`disttrain train` of the common config into `run_dir`, the row's overrides replacing the
    common ones of the same key (Hydra refuses a group chosen twice: amp=bf16 amp=fp8)."""
    gpu = opts["device"] == "cuda"
    common = [
        f"hydra.run.dir={run_dir}", "model=gpt", "strategy=single", f"amp={opts['amp']}",
        f"backend={'nccl' if gpu else 'gloo'}", "nproc_per_node=1",
        f"data.block_size={opts['block']}", f"model.dim={opts['dim']}", f"model.n_layers={opts['layers']}",
        f"model.n_heads={opts['heads']}", f"trainer.batch_size={opts['batch']}",
        f"trainer.max_steps={opts['steps']}", f"trainer.log_every={LOG_EVERY}",
        # validation only after the last step, outside every window (0 would validate at each epoch's end)
        f"trainer.val_every={opts['steps'] + 1}",
        "trainer.ckpt_every=0", "trainer.progress=false", "optim=adamw", "optim.lr=3e-4",
        "optim.weight_decay=0.01", "checkpoint.export_final=false",
    ]  # fmt: skip
    args = {o.partition("=")[0]: o for o in common} | {o.partition("=")[0]: o for o in overrides}
    return [sys.executable, "-m", "disttrain", "train", *args.values()]


def disttrain(opts: dict[str, Any], work: Path, overrides: tuple[str, ...]) -> dict[str, float]:
    """One `disttrain train` run into a new dir under `work`: its median windowed tokens/s, MFU and
    last logged loss. The run dir (its final checkpoint: ~16 GB at the default size) is deleted once
    read; a failed run's is kept (BenchFailed names it)."""
    run_dir = work / f"run_{time.time_ns()}"
    run_logged(command(opts, run_dir, overrides), run_dir)
    records = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln]
    shutil.rmtree(run_dir)
    logged = [r for r in records if "tokens_per_s" in r]
    steady = [r for r in logged if r["step"] > opts["warmup"]]
    return {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
        "mfu": statistics.median(r.get("mfu", float("nan")) for r in steady),
        "loss": logged[-1]["train/loss"],
    }


def measure(opts: dict[str, Any], rows: list[str], gpus: int) -> dict[str, dict[str, float] | str]:
    """Each row's medians over the repeats (interleaved: repeat 1 of every row, then repeat 2...),
    or why it failed. One run dir at a time, under a temporary folder removed at the end unless a
    failed run's dir is kept in it."""
    runs: dict[str, list[dict[str, float]]] = {row: [] for row in rows}
    failed: dict[str, str] = {}
    work = Path(tempfile.mkdtemp(prefix="bench_gpu_"))
    for _ in range(opts["repeats"]):
        for row in rows:
            if row in failed:
                continue
            overrides = fsdp_overrides(gpus) if row == "fsdp" else ROWS[row]
            try:
                runs[row].append(bare(opts) if overrides is None else disttrain(opts, work, overrides))
            except BenchFailed as exc:
                failed[row] = str(exc)
    if not any(work.iterdir()):
        work.rmdir()
    out: dict[str, dict[str, float] | str] = dict(failed)
    for row, results in runs.items():
        if results:
            out[row] = {m: statistics.median(r[m] for r in results) for m in results[0]}
    return {row: out[row] for row in rows}


def report(opts: dict[str, Any], table: dict[str, dict[str, float] | str], name: str, gpus: int) -> None:
    print(
        f"{name} | gpt dim {opts['dim']} x {opts['layers']} layers, context {opts['block']}, "
        f"batch {opts['batch']} per rank, {opts['steps']} steps, amp {opts['amp']} unless the row says, "
        f"AdamW, median of {opts['repeats']}"
    )
    ok = {row: m for row, m in table.items() if not isinstance(m, str)}
    for row, m in table.items():
        if isinstance(m, str):
            print(f"{row:17s} FAILED:\n{m}\n")
        else:
            print(f"{row:17s} {m['tokens_per_s']:12,.0f} tokens/s  MFU {m['mfu']:.3f}  loss {m['loss']:.4f}")
    single = ok.get("single", {}).get("tokens_per_s")
    if single and "bare" in ok:
        print(f"single / bare tokens/s: {single / ok['bare']['tokens_per_s']:.3f} (the engine's cost)")
    for row in ("regional compile", "selective AC", "fp8"):
        if single and row in ok:
            print(f"{row} / single tokens/s: {ok[row]['tokens_per_s'] / single:.3f}")
    if single and "fsdp" in ok:
        ranks = max(gpus, 1)
        print(
            f"fsdp on {ranks} rank(s), per rank / single tokens/s: {ok['fsdp']['tokens_per_s'] / ranks / single:.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--block", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--warmup", type=int, default=30, help="steps left out (compile, allocator warm-up)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), help="default: all (on CPU: CPU_ROWS)")
    parser.add_argument("--bare-json", help=argparse.SUPPRESS)  # the child process of bare()
    args = parser.parse_args()
    if args.bare_json:
        print(json.dumps(bare_loop(json.loads(args.bare_json))))
        return
    import torch

    opts = vars(args) | {"device": "cuda", "amp": "bf16"}
    rows = opts.pop("rows") or list(ROWS)
    del opts["bare_json"]
    gpus = torch.cuda.device_count()
    if not torch.cuda.is_available():
        print(
            "bench_gpu: no CUDA GPU here (torch.cuda.is_available() is False): running a small CPU "
            "config to check the script itself; these are not GPU numbers"
        )
        opts |= SMALL_CPU | {"device": "cpu", "amp": "off"}
        rows = args.rows or CPU_ROWS
    table = measure(opts, rows, gpus)
    report(opts, table, torch.cuda.get_device_name() if gpus else "CPU", gpus)
    if any(isinstance(m, str) for m in table.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
