"""The folder of checkpoints, by name, and its pointers (`latest`, `best`):

<run dir>/checkpoints/
  step_00000017/         one committed checkpoint; a folder appears under this name only whole
    .metadata __0_0.distcp __1_0.distcp ...   DCP: model, optimizer, scheduler; shards per rank
    rng_rank0.pt ...     RNG states of each rank (torch.save; loaded with weights_only=True)
    meta.json            step, epoch, position inside the epoch, world size, config and its hash
    manifest.json        size and xxh3_64 of every file above (summed as each was written, by the
                         rank that wrote it; gathered on rank 0): written last, marks a whole save;
                         older versions' manifests carry crc32 or sha256 instead, still verified
  .tmp-step_00000020/    a save in progress (or one a crash interrupted: ignored, later removed)
  latest                 the newest committed checkpoint's name, replaced with os.replace
  final.pt               {"model": state_dict, "step", "epoch"}: the consolidated model for plain
                         PyTorch under "model" (checkpoint.export_final)
  superseded/step_N/     checkpoints past the step a run resumed from (an abandoned timeline)
"""

from __future__ import annotations

import logging
from pathlib import Path

from disttrain.checkpoint.files import fsync_dir
from disttrain.storage import ObjectPath

log = logging.getLogger("disttrain")

LATEST, MANIFEST, META = "latest", "manifest.json", "meta.json"
BEST = "best"  # checkpoint.keep_best: names the best checkpoint by checkpoint.monitor
PREFIX, TMP, SUPERSEDED = "step_", ".tmp-", "superseded"


def step_name(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def point_latest(ckpt_dir: Path, name: str) -> None:
    """Replace `latest` through a fresh, randomly named temp file: a symlink planted at a
    predictable name (`.latest.tmp`) is never written through, and `latest` is a regular file."""
    from disttrain.safefile import write_atomic

    write_atomic(ckpt_dir / LATEST, (name + "\n").encode(), sync=True)
    fsync_dir(ckpt_dir)


def point_best(ckpt_dir: Path | ObjectPath, name: str) -> None:
    """`best`: the name of the best checkpoint by checkpoint.monitor (written as `latest` is)."""
    from disttrain.safefile import write_atomic

    if isinstance(ckpt_dir, ObjectPath):
        (ckpt_dir / BEST).write_text(name + "\n")  # one PUT: whole or absent
        return

    write_atomic(ckpt_dir / BEST, (name + "\n").encode(), sync=True)


def read_best(ckpt_dir: Path | ObjectPath) -> str | None:
    try:
        return (ckpt_dir / BEST).read_text().strip() or None
    except OSError:
        return None


def read_latest(ckpt_dir: Path | ObjectPath) -> str | None:
    try:
        return (ckpt_dir / LATEST).read_text().strip() or None
    except OSError:
        return None
