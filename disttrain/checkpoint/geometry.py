"""Resuming at another data-parallel size continues the same run: the same global batch.

A checkpoint records the samples one optimizer step took (`global_batch` = replicas x batch_size x
grad_accum) and the replicas (`dp_world_size`). Resumed at another number of replicas with the
per-rank batch unchanged, the global batch would change with it: 2 ranks -> 1 halved it, doubled
the batches per epoch (a finished 10-epoch run trained 220 more steps, 15 epochs), and broke the
schedule's position. Here the per-rank batch and accumulation are recomputed so that a step takes
the same samples: the same global permutation, cut in the same places, so the same samples form
each step, the schedule's horizon and `max_epochs` stay, and a finished run stays finished.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from disttrain.config.errors import ConfigError
from disttrain.storage import ObjectPath

if TYPE_CHECKING:
    from disttrain.config.run import Run


def batch_shape(batch_size: int, global_batch: int, replicas: int) -> tuple[int, int] | None:
    """(batch_size, grad_accum) with replicas x batch x accum = global_batch and the per-rank batch
    no larger than `batch_size` (no new memory per rank), the largest such batch; None if none."""
    if global_batch % replicas:
        return None
    per_rank = global_batch // replicas
    for batch in range(min(batch_size, per_rank), 0, -1):
        if per_rank % batch == 0:
            return batch, per_rank // batch
    return None


def checkpoint_meta(location: Path | ObjectPath | None) -> dict[str, Any] | None:
    """meta.json of the checkpoint a resume from `location` starts with (None: none there)."""
    from disttrain import checkpoint

    if location is None:
        return None
    path = checkpoint.choose(location, "size")
    if path is None:
        return None
    try:
        return checkpoint.read_meta(path)
    except (OSError, ValueError):
        return None


def keep_global_batch(run: Run, meta: dict[str, Any] | None, replicas: int) -> tuple[Run, str | None]:
    """`run` with `trainer.batch_size`/`trainer.grad_accum` such that one step takes the checkpoint's
    global batch at `replicas` data-parallel replicas (a new Run), and what changed; `run` itself
    and None when nothing changes.

    Only when the replicas differ from the checkpoint's and the batch keys are the checkpoint's own:
    a user who set a new batch shape on resume gets exactly that.
    """
    if meta is None:
        return run, None
    saved, saved_dp = meta.get("global_batch"), meta.get("dp_world_size")
    if not isinstance(saved, int) or not isinstance(saved_dp, int) or saved_dp == replicas or saved < 1:
        return run, None
    trainer = run.trainer
    recorded = meta.get("config")
    flat: dict[str, Any] = recorded if isinstance(recorded, dict) else {}
    if (flat.get("trainer.batch_size"), flat.get("trainer.grad_accum")) != (
        trainer.batch_size,
        trainer.grad_accum,
    ):
        return run, None
    now = trainer.batch_size * trainer.grad_accum * replicas
    if now == saved:
        return run, None
    shape = batch_shape(trainer.batch_size, saved, replicas)
    if shape is None:
        raise ConfigError(
            "nproc_per_node",
            run.world.nproc_per_node,
            f"a world whose {replicas} data-parallel replicas divide the checkpoint's global batch {saved}",
            f"the checkpoint was trained with {saved} samples per step on {saved_dp} replicas; resume on "
            f"a number of replicas that divides {saved} (e.g. {saved_dp}), or set trainer.batch_size and "
            "trainer.grad_accum yourself to train on with another global batch.",
        )
    before = (trainer.batch_size, trainer.grad_accum)
    reshaped = run.updated({"trainer": {"batch_size": shape[0], "grad_accum": shape[1]}})
    return reshaped, (
        f"data-parallel replicas {saved_dp} -> {replicas}: trainer.batch_size {before[0]} -> {shape[0]}, "
        f"trainer.grad_accum {before[1]} -> {shape[1]} keep the checkpoint's global batch of {saved}"
    )
