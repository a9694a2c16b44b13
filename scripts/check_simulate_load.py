"""Check `plan --simulate --load-at`'s save side against a real DCP save (a few CPU-seconds).

Spawns the layout's ranks on gloo (CPU), sets up the configured strategy for real, saves model and
optimizer with DCP, then compares the checkpoint's `.metadata` with what `simulate_load.plan_save`
predicts on meta tensors: the same keys, the same chunks of every tensor, and the same saved rank's
file for every chunk. Usage (4 ranks fsdp+tp by default; any overrides):

    python scripts/check_simulate_load.py nproc_per_node=4 strategy=fsdp strategy.replicate=2
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

GPT = [
    "model=gpt",
    "model.dim=128",
    "model.n_layers=1",
    "model.n_heads=8",
    "data.block_size=64",
    "optim=adamw",
]


def config(layout: list[str]) -> dict[str, Any]:
    from disttrain.config import compose, resolve

    return resolve(compose(GPT + layout))


def rank(r: int, world: int, path: str, layout: list[str]) -> None:
    import torch.distributed.checkpoint as dcp

    from disttrain.config.schema import AmpConfig, Optim
    from disttrain.config.typed import typed
    from disttrain.dist import DistEnv
    from disttrain.engine.optim import build_optimizer
    from disttrain.models import build_model
    from disttrain.strategies import build_strategy

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    dist.init_process_group("gloo", rank=r, world_size=world)
    cfg = config(layout)
    env = DistEnv(r, r, world, world, "gloo", torch.device("cpu"))
    strategy = build_strategy(cfg["strategy"], env, typed(AmpConfig, cfg["amp"]))
    model = strategy.setup_module(build_model(cfg["model"]))
    opt = strategy.setup_optimizer(
        build_optimizer(Optim.of(cfg["optim"]), model, strategy.data_parallel_rank_size()[1])
    )
    state = {"model": strategy.state_dict(model, opt)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path, thread_count=1))
    dist.destroy_process_group()


def main(layout: list[str]) -> int:
    import torch.distributed.checkpoint as dcp

    from disttrain.config.common import world_size
    from disttrain.strategies import specs
    from disttrain.tools.simulate_load import plan_save

    cfg = config(layout)
    world = world_size(cfg)
    path = tempfile.mkdtemp()
    mp.spawn(rank, args=(world, path, layout), nprocs=world)
    real = dcp.FileSystemReader(path).read_metadata()
    saved = plan_save(cfg, world, specs.of(cfg)[0].name)
    got, want = real.state_dict_metadata, saved.metadata.state_dict_metadata

    def chunks(md: Any) -> list[tuple[Any, ...]]:
        return sorted((tuple(c.offsets), tuple(c.sizes)) for c in getattr(md, "chunks", []))

    files = {k: int(v.relative_path.split("_")[2]) for k, v in real.storage_data.items()}
    bad_chunks = [k for k in got if k not in want or chunks(got[k]) != chunks(want[k])]
    bad_files = [k.fqn for k, r in files.items() if saved.writer.get(k) != r]
    print(
        f"{len(got)} keys ({set(got) == set(want)} equal), {len(bad_chunks)} with other chunks, "
        f"{len(files) - len(bad_files)} of {len(files)} chunks in the predicted rank's file"
    )
    return 1 if bad_chunks or bad_files or set(got) != set(want) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["nproc_per_node=4", "strategy=fsdp+tp", "strategy.tp_degree=2"]))
