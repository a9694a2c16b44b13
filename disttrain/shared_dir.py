"""Where checkpoints go, and whether every node sees that place: probed before the first step.

DCP writes one shard per rank into a checkpoint directory that rank 0 creates and commits, so every
node must see the same directory. Without a shared file system (each node its own run dir) a run
would train to the end and only then fail writing a shard; the probe fails it before training.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from disttrain.config.errors import ConfigError
from disttrain.config.run import Run
from disttrain.rundir import RunDir
from disttrain.storage import ObjectPath, is_url

KEY = "checkpoint.dir"


def checkpoint_dir(run: Run | Mapping[str, Any], run_dir: Path) -> Path | ObjectPath:
    """`checkpoint.dir`, else `<run dir>/checkpoints`. Of a run, or of a run dir's plain
    config.yaml (`disttrain eval` finds the checkpoint before the config is checked and trusted).
    Composition freezes it absolute (config.compose.absolute_paths); a relative one (a config.yaml
    from before) is read from the working directory."""
    chosen = _chosen(run)
    if chosen and is_url(chosen):  # s3://, gs://: an object store every node reaches
        return ObjectPath(str(chosen))
    return Path(str(chosen)).absolute() if chosen else RunDir(run_dir).checkpoints


def _chosen(run: Run | Mapping[str, Any]) -> str | None:
    chosen: str | None = run.checkpoint.dir if isinstance(run, Run) else run["checkpoint"]["dir"]
    return chosen


def check_shared(run: Run | Mapping[str, Any], run_dir: Path, env: Any) -> None:
    """Node 0 writes a token into the checkpoint dir; every other rank looks for it there.

    A collective on every rank (only with several nodes: one node always sees its own files).
    Raises the same ConfigError on every rank when any node cannot see the token.
    """
    import torch.distributed as dist

    if not dist.is_initialized() or env.world_size == env.local_world_size:
        return
    directory = checkpoint_dir(run, run_dir)
    if isinstance(directory, ObjectPath):  # every node reaches the store (probed before launch)
        return
    box: list[Any] = [None]
    if env.is_zero:
        directory.mkdir(parents=True, exist_ok=True)
        token = f".node0-probe-{uuid.uuid4().hex}"
        (directory / token).write_text(token)
        box = [token]
    dist.broadcast_object_list(box, src=0)
    seen = _sees(directory / box[0], box[0])
    views: list[Any] = [None] * env.world_size
    dist.all_gather_object(views, (seen, env.rank // max(1, env.local_world_size), _host()))
    if env.is_zero:
        (directory / box[0]).unlink(missing_ok=True)
    blind = sorted({(node, host) for ok, node, host in views if not ok})
    if not blind:
        return
    where = ", ".join(f"node {n} ({h})" for n, h in blind)
    given = _chosen(run)
    raise ConfigError(
        KEY,
        given,
        f"a directory every node sees: node 0 wrote a token into {directory}, which {where} cannot "
        "see, so the checkpoint shards of those nodes' ranks could not be written there "
        "(nothing was trained)",
        f"set {KEY}=PATH on a file system every node mounts (NFS, Lustre, a shared volume), the "
        "same on every node; or give every node the same run dir on such a file system "
        "(hydra.run.dir=/shared/runs/NAME).",
    )


def _sees(path: Path, token: str, patience_s: float = 5.0) -> bool:
    """Whether the token is there; a network file system may show a new file a moment late."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            if path.read_text() == token:
                return True
        except OSError:
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(0.25)


def _host() -> str:
    return os.uname().nodename
