"""Resuming at another data-parallel size continues the same run (docs-as-written review §2A):
`disttrain resume RUN nproc_per_node=1` of a finished 2-rank, 10-epoch run trained 220 more steps
(15 epochs), the global batch halved (64 -> 32) and the learning rate jumped back."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from unit_support import checked

from disttrain.checkpoint.geometry import batch_shape, keep_global_batch
from disttrain.config.errors import ConfigError
from disttrain.config.fingerprint import shaping_config
from disttrain.config.run import Run
from disttrain.engine.optim import total_steps


@pytest.mark.parametrize(
    ("batch", "global_batch", "replicas", "shape"),
    [
        (32, 64, 1, (32, 2)),  # 2 -> 1 rank: accumulate twice
        (32, 64, 2, (32, 1)),
        (32, 32, 2, (16, 1)),  # 1 -> 2 ranks: half the per-rank batch
        (32, 96, 4, (24, 1)),
        (32, 64, 3, None),  # 3 replicas cannot split 64 samples evenly
        (8, 64, 1, (8, 8)),  # never a larger per-rank batch than configured (memory)
    ],
)
def test_batch_shape(batch: int, global_batch: int, replicas: int, shape: tuple | None) -> None:
    assert batch_shape(batch, global_batch, replicas) == shape


def _meta(cfg: dict, replicas: int) -> dict:
    t = cfg["trainer"]
    return {
        "global_batch": t["batch_size"] * t["grad_accum"] * replicas,
        "dp_world_size": replicas,
        "config": shaping_config(cfg),
    }


def test_a_finished_two_rank_run_resumed_on_one_rank_has_the_same_horizon() -> None:
    """The review's numbers: 2 ranks x 32 = 64 per step on the digits; at 1 rank the same steps
    per epoch and the same total, so a finished run stays finished."""
    two = checked(["trainer.max_epochs=10"])
    batches_two = 1437 // 2 // 32  # the digits' training split, per rank (DistributedSampler, drop_last)
    one = copy.deepcopy(two)
    one["nproc_per_node"] = 1
    before = Run.of(one)
    resumed, note = keep_global_batch(before, _meta(two, 2), replicas=1)
    assert note is not None and "keep the checkpoint's global batch of 64" in note
    assert (resumed.trainer.batch_size, resumed.trainer.grad_accum) == (32, 2)
    assert (before.trainer.batch_size, before.trainer.grad_accum) == (32, 1)  # a new run: this one stays
    batches_one = 1437 // 32
    assert total_steps(resumed.trainer, batches_one) == total_steps(two["trainer"], batches_two) == 220


def test_nothing_changes_at_the_same_world_or_with_a_batch_the_user_chose() -> None:
    cfg = checked([])
    same = Run.of(cfg)
    assert keep_global_batch(same, _meta(cfg, 2), replicas=2) == (same, None) and same.to_dict() == cfg
    chosen = copy.deepcopy(cfg)
    chosen["trainer"]["batch_size"] = 8  # `resume RUN nproc_per_node=1 trainer.batch_size=8`: theirs
    run = Run.of(chosen)
    assert keep_global_batch(run, _meta(cfg, 2), replicas=1) == (run, None)
    assert run.trainer.batch_size == 8
    run = Run.of(cfg)
    assert keep_global_batch(run, None, replicas=1) == (run, None)  # no checkpoint


def test_a_world_that_cannot_keep_the_global_batch_is_one_paragraph() -> None:
    cfg = checked([])
    three = Run.of(cfg)
    with pytest.raises(ConfigError, match="divide the checkpoint's global batch 64"):
        keep_global_batch(three, _meta(cfg, 2), replicas=3)


def _resume_report(meta: dict, now: dict, caplog: pytest.LogCaptureFixture) -> str:
    """The lines a resume logs on rank 0 for a checkpoint's meta.json and the run's own run_info."""
    import logging
    from types import SimpleNamespace

    from disttrain.checkpoint.manager import Checkpointer

    base = {"step": 6, "epoch": 0, "epoch_samples": 80, "reason": "periodic", "global_batch": 16}
    ckpt = SimpleNamespace(env=SimpleNamespace(is_zero=True, world_size=1), run_info=now)
    with caplog.at_level(logging.INFO):
        Checkpointer._report(ckpt, Path("ck/step_6"), {**base, **meta})  # type: ignore[arg-type]
    return caplog.text


def test_d16_a_token_file_changed_since_the_checkpoint_is_named_on_resume(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Reliability review 2026-11-28 D16: a data=tokens file doubled or cut between a checkpoint and
    `disttrain resume` resumed silently ("96 samples into the epoch" of a 42-window epoch)."""
    then, now = {"data_files": {"/d/data.bin": 40000}}, {"data_files": {"/d/data.bin": 3000}}
    text = _resume_report(then, now, caplog)
    assert "the training data changed since the checkpoint (/d/data.bin: 40000 -> 3000 bytes)" in text
    caplog.clear()
    assert "changed" not in _resume_report(then, then, caplog)


def test_d23_a_stream_resumed_at_another_dp_size_gets_no_data_order_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """D23: a stream resumed 2 -> 1 ranks was told its epoch "keeps its seeded permutation and
    continues at global sample 80" and then, truly, that the stream is read from its start."""
    text = _resume_report({"dp_world_size": 2}, {"dp_world_size": 1, "data_stream": True}, caplog)
    assert "world size 2 -> 1" in text and "seeded permutation" not in text
    caplog.clear()
    text = _resume_report({"dp_world_size": 2}, {"dp_world_size": 1, "data_stream": False}, caplog)
    assert "keeps its seeded permutation and continues at global sample 80" in text
