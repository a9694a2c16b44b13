"""`disttrain bench comm`'s timing vs a bare torch.distributed loop: the harness adds nothing measurable.

Both sides run in the same 2 gloo ranks (torch.multiprocessing), interleaved per round so machine
noise hits both alike: the harness is disttrain.tools.commbench.time_loop over the Case the bench
builds (the same code path the CLI runs), the bare loop is `for _ in range(iters): dist.all_reduce(buf)`
between a barrier and perf_counter. Prints per-size median times and the ratio harness / bare.

    python scripts/bench_comm_overhead.py            # ~20 s on 2 cores
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from typing import Any


def _rank(rank: int, port: int, opts: dict[str, Any], queue: Any) -> None:
    import torch
    import torch.distributed as dist

    from disttrain.dist import DistEnv
    from disttrain.tools.collectives import make_case
    from disttrain.tools.commbench import time_loop

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    env = DistEnv(rank, rank, 2, 2, "gloo", torch.device("cpu"))
    out = []
    for nbytes in opts["sizes"]:
        case = make_case("all_reduce", nbytes, rank, 2, torch.float32, env.device)
        buf = torch.zeros(case.nbytes // 4)
        harness, bare = [], []
        for _ in range(opts["rounds"]):
            harness.append(time_loop(case.run, opts["iters"], env.device))
            dist.barrier()
            start = time.perf_counter()
            for _ in range(opts["iters"]):
                dist.all_reduce(buf)
            bare.append((time.perf_counter() - start) / opts["iters"])
        out.append((case.nbytes, statistics.median(harness), statistics.median(bare)))
    if rank == 0:
        queue.put(out)
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    opts = {"sizes": [8, 1024, 64 << 10, 1 << 20], "rounds": args.rounds, "iters": args.iters}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_rank, args=(port, opts, queue), nprocs=2, start_method="spawn")
    rows = queue.get()
    print(f"{'bytes':>10} {'harness us':>11} {'bare us':>9} {'ratio':>7}")
    for nbytes, h, b in rows:
        print(f"{nbytes:>10} {h * 1e6:>11.1f} {b * 1e6:>9.1f} {h / b:>7.3f}")
    ratios = [h / b for _, h, b in rows]
    print(f"median ratio harness / bare: {statistics.median(ratios):.3f} (1.000 = no overhead)")


if __name__ == "__main__":
    main()
