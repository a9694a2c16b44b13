"""Ranks someone else started: torchrun, Kubeflow TrainJob/PyTorchJob, TorchX dist.ddp, an srun.

Every rank composes and checks the config (a mistake fails every rank before any process group),
then the nodes compare config hashes as the by-hand roll call does. Rank 0 freezes the run dir and
sends the frozen config itself (not its path) to every rank over the process group; a node that
does not see rank 0's run dir (no shared file system) freezes its own copy, and its ranks log
there. Each run dir records the real launch (launch.json: launcher, command, world) and its status.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from disttrain.launch.multinode import config_diff, config_hash, flatten

if TYPE_CHECKING:
    from disttrain.config.run import Run


def fill_local_env() -> None:
    """LOCAL_RANK / LOCAL_WORLD_SIZE where the launcher sets only RANK and WORLD_SIZE.

    A Kubeflow pod (one process per pod, or PET_NPROC_PER_NODE of them) or a user's srun (one task
    per rank) has no LOCAL_* variables; read as "every rank on one node", the run would record
    one node and skip the shared-directory probe. Without any hint a process is its own node.
    """
    if "LOCAL_WORLD_SIZE" not in os.environ:
        per_node = os.environ.get("PET_NPROC_PER_NODE") or os.environ.get("SLURM_NTASKS_PER_NODE") or "1"
        per_node = per_node.split("(")[0]  # SLURM_NTASKS_PER_NODE may read "2(x3)"
        os.environ["LOCAL_WORLD_SIZE"] = per_node if per_node.isdigit() else "1"
    if "LOCAL_RANK" not in os.environ:
        local = os.environ.get("SLURM_LOCALID")
        if local is None:
            local = str(int(os.environ["RANK"]) % int(os.environ["LOCAL_WORLD_SIZE"]))
        os.environ["LOCAL_RANK"] = local


def launcher_name() -> str:
    """Which outside launcher started this rank, as its environment tells: the detected launcher's
    name for it (`disttrain.launch.specs.started_by`: torchrun, also TorchX dist.ddp, Kubeflow's
    torchrun-based runtimes, SkyPilot recipes; kubeflow; srun; a plug-in's), else env."""
    from disttrain.launch.specs import started_by

    return started_by(os.environ)


def launch_command() -> list[str]:
    """The command the user ran: torchrun's own command line when torchrun started this rank."""
    from disttrain.launch.specs import torchrun

    if torchrun.detect(os.environ):  # the agent's command line is the one the user ran
        with contextlib.suppress(OSError):
            raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
            agent = [a.decode(errors="replace") for a in raw.split(b"\0") if a]
            if agent and any("torchrun" in a or "torch.distributed.run" in a for a in agent[:3]):
                return [Path(agent[0]).name, *agent[1:]]
    from disttrain.rundir import command_line

    return command_line()


def launched_shape(run: Run, env: Any) -> Run:
    """The run with the world the outside launcher made: what every rank checks and freezes.

    `disttrain resume` of this run dir then launches the same world, and data-size checks see it.
    """
    local = max(1, env.local_world_size)
    return run.updated(
        {
            "nproc_per_node": local,
            "nodes": max(1, env.world_size // local),
            "node_rank": int(os.environ.get("GROUP_RANK", env.rank // local)),
            "launcher": {"min_nodes": 0},
        }
    )


def agree(run: Run, env: Any) -> str | None:
    """Every rank's config against rank 0's: None, or the message naming the keys that differ."""
    import torch.distributed as dist

    mine = json.loads(json.dumps(flatten(run), default=str))
    views: list[Any] = [None] * env.world_size
    dist.all_gather_object(views, (config_hash(run), mine))
    local = max(1, env.local_world_size)
    for rank, (theirs_hash, theirs) in enumerate(views):
        if theirs_hash != views[0][0]:
            lines = "\n    ".join(config_diff(views[0][1], theirs, rank // local))
            return (
                f"config mismatch: rank 0 (node 0, hash {views[0][0][:12]}) and rank {rank} (node "
                f"{rank // local}, hash {theirs_hash[:12]}) were started with different configs:\n"
                f"    {lines}\n  HINT: every node must run the same command and config files."
            )
    return None


def record(run_dir: Path, run: Run, env: Any, present: list[int], owner: bool) -> None:
    """rendezvous_node<K>.json (the config hash, every node), launch.json (how the ranks were
    started: the run dir's owner, i.e. rank 0 or a node keeping its own copy)."""
    from disttrain.rundir import write_json

    node = run.world.node_rank
    write_json(
        run_dir / f"rendezvous_node{node}.json",
        {
            "config_hash": config_hash(run),
            "node_rank": node,
            "nodes": present,
            "launcher": launcher_name(),
        },
    )
    if not owner:
        return
    write_json(
        run_dir / "launch.json",
        {
            "launcher": launcher_name(),
            "command": launch_command(),
            "world_size": env.world_size,
            "nodes": run.world.nodes,
            "nproc_per_node": run.world.nproc_per_node,
            "master": f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}",
        },
    )
