"""A user's IterableDataset through the CLI (issue 24): a stream over a memory-mapped token file that
shards itself by rank and worker trains a GPT (its loss falls) with 0 and 2 workers; resumed, from a
final checkpoint or after a SIGKILL, it ends bitwise like the uninterrupted run; a stream whose
position is not saved resumes with one warning. All runs but the killed one are one sweep."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

from .conftest import _group_members, final_weights, train_losses, write_module
from .sweep import Sweep, run_sweep
from .test_faults import _rank_pid, _start, _wait, _wait_for_step

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STREAM = '''
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info


class TokenStream(IterableDataset):
    """Windows of a uint16 token file, each rank and worker reading its own (as the review's)."""

    def __init__(self, path, block_size=32, delay=0.0):
        self.path, self.block, self.delay = path, block_size, delay

    def __iter__(self):
        data = np.memmap(self.path, dtype=np.uint16, mode="r")
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        for i in range(rank * workers + worker, (len(data) - 1) // self.block, world * workers):
            time.sleep(self.delay)
            chunk = torch.from_numpy(data[i * self.block : (i + 1) * self.block + 1].astype(np.int64))
            yield chunk[:-1], chunk[1:]
'''

STEPS = 20
COMMON = (
    "model=gpt",
    "model.dim=32",
    "data.block_size=32",
    "data.num_classes=64",
    "sched=constant",
    "optim.lr=3e-3",
    "trainer.batch_size=8",
    "trainer.log_every=1",
    "nproc_per_node=2",
)
NOSTATE = ("data.num_workers=0", "data.stateful=false")


@pytest.fixture(scope="module")
def cwd(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cwd = tmp_path_factory.mktemp("streams")
    pattern = np.random.default_rng(0).integers(0, 64, 97)
    np.tile(pattern, 400).astype(np.uint16).tofile(cwd / "tokens.bin")  # 38,800 tokens, learnable
    return cwd


def _stream(cwd: Path) -> list[str]:
    """The user's stream over the token file, no validation."""
    return [
        "data.train._target_=streamlab.TokenStream",
        f"data.train.path={cwd / 'tokens.bin'}",
        "data.val=null",
    ]


def _user_folder(path: Path) -> Path:
    path.mkdir(exist_ok=True)
    write_module(path, "streamlab", STREAM)
    return path


@pytest.fixture(scope="module")
def runs(cwd: Path) -> Sweep:
    """Two sweeps: the uninterrupted runs and the first halves (stopped at step 10, their final
    checkpoint in a folder of their own), then the second halves, from those (resume=PATH)."""
    w2, none, stream = cwd / "ckpt_w2", cwd / "ckpt_none", _stream(cwd)
    first = {
        "w0": [*stream, "data.num_workers=0", f"trainer.max_steps={STEPS}"],
        "w2": [*stream, "data.num_workers=2", f"trainer.max_steps={STEPS}"],
        "w2-first": [*stream, "data.num_workers=2", "trainer.max_steps=10", f"checkpoint.dir={w2}"],
        "nostate-first": [*stream, *NOSTATE, "trainer.max_steps=10", f"checkpoint.dir={none}"],
    }
    runs = run_sweep(_user_folder(cwd / "first"), first, *COMMON)
    rest = {
        "w2-rest": [*stream, "data.num_workers=2", f"trainer.max_steps={STEPS}", f"resume={w2}"],
        "nostate-rest": [*stream, *NOSTATE, f"trainer.max_steps={STEPS}", f"resume={none}"],
        # the built-in data=tokens on the same file: random windows, the tail validates
        "tokens": ["data=tokens", f"data.path={cwd / 'tokens.bin'}", "data.val_fraction=0.1",
                   "trainer.val_batches=3", f"trainer.max_steps={STEPS}"],
    }  # fmt: skip
    resumed = run_sweep(_user_folder(cwd / "rest"), rest, *COMMON)
    for name in rest:
        runs.add(name, resumed[name])
    return runs


@pytest.mark.parametrize("name", ["w0", "w2", "tokens"])
def test_a_user_stream_trains_an_lm_and_its_loss_falls(runs: Sweep, name: str) -> None:
    losses = train_losses(runs[name])
    assert len(losses) == STEPS
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3, losses
    if name == "tokens":  # validated on the held-out tail, 3 batches per rank
        summary = json.loads((runs[name] / "summary.json").read_text())
        assert summary["val/loss"] < losses[0], summary


def test_a_stream_resumed_from_a_checkpoint_ends_bitwise_like_the_uninterrupted_run(runs: Sweep) -> None:
    assert "resuming from" in runs.log("w2-rest")
    assert "will not replay" not in runs.log("w2-rest")
    _assert_equal(final_weights(runs["w2-rest"]), final_weights(runs["w2"]))


def test_a_stream_without_its_position_resumes_with_one_warning(runs: Sweep) -> None:
    log = (runs["nostate-rest"] / "logs" / "rank0.log").read_text()
    assert log.count("will not replay the same samples") == 1, log[-2000:]
    assert "data.stateful=false" in log
    assert "will not replay" not in runs.log("nostate-first")


def test_a_stream_killed_by_sigkill_restarts_and_ends_bitwise_like_the_uninterrupted_run(
    cwd: Path, runs: Sweep
) -> None:
    run_dir = cwd / "killed"
    proc = _start(
        _user_folder(cwd / "killed_cwd"),
        *COMMON,
        *_stream(cwd),
        "data.num_workers=2",
        f"trainer.max_steps={STEPS}",
        "data.train.delay=0.03",  # ~0.12 s a step: the kill lands well before the last step
        "trainer.ckpt_every=4",
        "launcher.max_restarts=1",
        "backend.name=gloo",
        f"hydra.run.dir={run_dir}",
    )
    _wait_for_step(proc, run_dir, 6)
    os.kill(_rank_pid(run_dir, 1), signal.SIGKILL)
    _, err = _wait(proc, 240)
    assert proc.returncode == 0, err[-3000:]
    log = (run_dir / "logs" / "rank0.log").read_text()
    assert log.count("resuming from") == 1 and "will not replay" not in log
    _assert_equal(final_weights(run_dir), final_weights(runs["w2"]))
    assert not _group_members(proc.pid)


def _assert_equal(weights: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert weights.keys() == reference.keys()
    assert all(torch.equal(weights[k], reference[k]) for k in weights), "final weights differ"
