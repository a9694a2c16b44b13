"""init.path on a sharded model: peak RSS per rank and load time, against a plain load_state_dict.

    python scripts/bench_init.py [--mb 256] [--width 2048]

One invocation, three sides, each in two fresh gloo ranks (so each rank's peak RSS is that side's
alone), on the same weights (an MLP of --mb MiB of fp32 Linear layers, no non-persistent buffers):

- plain: what a user does without disttrain's init: every rank builds the full model on the CPU,
  `torch.load`s the consolidated file (checkpoints/final.pt's layout) and `load_state_dict`s it.
- fsdp (CPU build): what `disttrain train strategy=fsdp init.path=CKPT` does for a model it cannot
  build on the meta device (tied parameters, non-persistent buffers, a factory that refuses meta):
  the full model built on the CPU (the factory's own init), `fully_shard`, then `init_from.apply`
  from the DCP checkpoint (each rank's DTensor chunks through DCP's planner).
- fsdp (meta build): what it does otherwise (`init_from.build`): the model built on the meta
  device, `fully_shard`, `to_empty(device="cpu")`, then the same `init_from.apply`: no rank ever
  holds the whole model.

The DCP checkpoint is written first by two fsdp ranks (two shard files, as an fsdp run leaves it).
Peak RSS per rank is ru_maxrss minus the rank's RSS before it built the model (imports, process
group), so it counts the model and the load only; the goal is < 0.6 x the full model's size at 2
ranks. Load time is the time of the load alone (torch.load + load_state_dict vs init_from.apply).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

GOAL = 0.6


def build(mb: int, width: int) -> nn.Module:
    layers = max(1, mb * 2**20 // (width * width * 4))
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def shard(model: nn.Module) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def rank_main(rank: int, side: str, args: argparse.Namespace, folder: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    import safetensors.torch  # noqa: F401  (imports counted before, not in the peak)
    import torch.distributed.checkpoint as _dcp  # noqa: F401

    from disttrain import checkpoint
    from disttrain.checkpoint import init_from
    from disttrain.config.schema import InitConfig
    from disttrain.rng import rng_state

    shard(nn.Sequential(nn.Linear(2, 2)))  # the mesh and FSDP's first-use costs, outside the peak

    ckpt, pt = Path(folder) / "checkpoints", Path(folder) / "final.pt"
    before = rss_mb()
    t0 = time.perf_counter()
    if side == "write":  # the source: two fsdp ranks' checkpoint, and the consolidated file
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        torch.manual_seed(0)
        model = shard(build(args.mb, args.width))
        checkpoint.save(
            ckpt, 1, {"model": model.state_dict()}, rng_state(), {"step": 1}, rank=rank, keep=1,
            verify="size", barrier=dist.barrier,
        )  # fmt: skip
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            torch.save({"model": full}, pt)
        dist.barrier()
        dist.destroy_process_group()
        return
    if side == "plain":
        model = build(args.mb, args.width)
        t0 = time.perf_counter()
        model.load_state_dict(torch.load(pt, map_location="cpu", weights_only=True)["model"])
    else:
        if side == "meta":
            with torch.device("meta"):
                model = build(args.mb, args.width)
            shard(model).to_empty(device="cpu")
        else:
            model = shard(build(args.mb, args.width))
        t0 = time.perf_counter()
        init_from.apply(InitConfig(path=str(ckpt)), model, is_zero=False)
    load_s = time.perf_counter() - t0
    check = sum(float(p.detach().float().sum()) for p in model.parameters() if not hasattr(p, "to_local"))
    if side != "plain":
        check = sum(float(p.detach().to_local().sum()) for p in model.parameters())  # type: ignore[attr-defined]
        total = torch.tensor([check], dtype=torch.float64)
        dist.all_reduce(total)
        check = float(total)
    result = {"peak_mb": peak_mb() - before, "load_s": load_s, "check": check}
    (Path(folder) / f"{side}.{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_side(side: str, args: argparse.Namespace, folder: str) -> list[dict[str, Any]]:
    mp.start_processes(rank_main, args=(side, args, folder, free_port()), nprocs=2, start_method="spawn")
    if side == "write":
        return []
    return [json.loads((Path(folder) / f"{side}.{r}.json").read_text()) for r in range(2)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=256, help="model size in MiB (fp32)")
    parser.add_argument("--width", type=int, default=2048)
    args = parser.parse_args()
    with torch.device("meta"):
        full_mb = sum(p.numel() * 4 for p in build(args.mb, args.width).parameters()) / 2**20
    with tempfile.TemporaryDirectory(prefix="bench_init.", dir=os.environ.get("TMPDIR")) as folder:
        run_side("write", args, folder)
        sides = {s: run_side(s, args, folder) for s in ("plain", "cpu", "meta")}
    plain = sides["plain"]
    print(f"full model {full_mb:.0f} MiB, 2 gloo ranks, torch {torch.__version__}")
    print(f"{'side':<36}{'peak RSS/rank MiB':>18}{'x full':>8}{'load s':>8}{'x plain':>9}")
    names = {
        "plain": "plain torch.load + load_state_dict",
        "cpu": "fsdp init.path, CPU build",
        "meta": "fsdp init.path, meta build",
    }
    for side, ranks in sides.items():
        peak = max(r["peak_mb"] for r in ranks)
        load = max(r["load_s"] for r in ranks)
        ratio = load / max(r["load_s"] for r in plain)
        print(f"{names[side]:<36}{peak:>18.0f}{peak / full_mb:>8.2f}{load:>8.2f}{ratio:>9.2f}")
    same = abs(sides["meta"][0]["check"] - sides["plain"][0]["check"]) <= 1e-3 * abs(
        sides["plain"][0]["check"]
    )
    meta_ratio = max(r["peak_mb"] for r in sides["meta"]) / full_mb
    print(
        f"weights equal across sides: {same}; goal peak < {GOAL} x full per rank: meta build {meta_ratio:.2f}"
    )


if __name__ == "__main__":
    main()
