"""`disttrain train` inside a rank an outside launcher started (`torchrun -m disttrain train ...`,
`srun ...`): agree on one config, freeze it per node, train. `launch/external.py` holds what this
flow asks of the environment (the launcher's variables, the launched shape, the node's record)."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

from disttrain.observe.summary import print_done
from disttrain.rundir import RunDir


def train_as_launched_rank(args: Any) -> int:
    """Inside a rank an outside launcher started: agree on one config, freeze it per node, train."""
    import torch.distributed as dist

    from disttrain import worker
    from disttrain.config import compose, resolve
    from disttrain.config.run import Run
    from disttrain.dist import DistEnv, exit_rank, init_process_group
    from disttrain.launch.external import agree, fill_local_env, launch_command, launched_shape, record
    from disttrain.preflight.checks import check_runtime, check_static
    from disttrain.procs import collector_back
    from disttrain.rundir import freeze, run_status
    from disttrain.strategies import specs

    fill_local_env()
    composed = Run.of(
        resolve(compose(args.overrides, args.config_dir, args.config_name or "config"), args.overrides)
    )
    env = DistEnv.from_env(str(composed.backend.name))
    run = launched_shape(composed, env)  # before the checks: data size vs the real world size
    check_static(run)
    check_runtime(run)
    # The program's start-up is over (cli.main turned the collector off until a launch, and this
    # rank makes none): on again, or the whole training would keep every cycle it makes.
    collector_back()
    init_process_group(env, run.backend.timeout, cpu_collectives=specs.cpu_collectives(run))
    problem = agree(run, env)
    if problem:
        sys.stderr.write(f"disttrain: {problem}\n")
        exit_rank(1)
    command = launch_command()
    box: list[Any] = [None, None]
    if env.is_zero:
        full = compose(args.overrides, args.config_dir, args.config_name or "config", with_hydra=True)
        run_dir = Path(str(full.hydra.run.dir)).resolve()
        freeze(run_dir, run, args.overrides, command)
        from disttrain.preflight import hf_base

        hf_base.record(run_dir, run.model)  # from_pretrained's config.json: export rebuilds from this copy
        box = [str(run_dir), run.to_dict()]
    dist.broadcast_object_list(box, src=0)  # the frozen config itself, not a path only rank 0 sees
    local = max(1, env.local_world_size)
    run_dir, frozen = Path(box[0]), Run.of(box[1]).updated({"node_rank": env.rank // local})
    # A node that does not see rank 0's run dir (no shared file system) keeps its own copy.
    own_copy = env.local_rank == 0 and not env.is_zero and not RunDir(run_dir).config.is_file()
    if own_copy:
        freeze(run_dir, frozen, args.overrides, command)
    owners: list[Any] = [None] * env.world_size
    dist.all_gather_object(owners, env.is_zero or own_copy)  # also a barrier: every copy is written
    nodes_present = sorted({r // local for r in range(env.world_size)})
    writes_status = bool(owners[env.rank])
    if env.local_rank == 0:
        record(run_dir, frozen, env, nodes_present, writes_status)
    status = run_status(run_dir) if writes_status else contextlib.nullcontext()
    with status:
        worker.run(run_dir)
    if env.is_zero:
        print_done(run_dir)
    exit_rank(0)  # a rank process: skip interpreter finalization (see exit_rank)
