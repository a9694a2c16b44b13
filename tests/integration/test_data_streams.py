"""Data at scale through the CLI (issue 24): a user's IterableDataset over a memory-mapped token file
that shards itself by rank and worker, data=tokens, data=hf streamed under FSDP and data=mix each
train a GPT (the loss falls); resumed mid-run on 2 ranks, each continues bitwise like its
uninterrupted run (a user stream also after a SIGKILL); a 1-rank run resumed on 2 ranks keeps the
global batch and ends like its uninterrupted run; a stream whose position is not saved resumes
with one warning. All runs but the killed one are the jobs of two sweeps (uninterrupted, resumed)."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from .conftest import (
    _group_members,
    final_weights,
    read_yaml,
    run_cli,
    train_losses,
    train_records,
    write_module,
)
from .sweep import Sweep, run_sweep
from .test_faults import _rank_pid, _start, _wait, _wait_for_step

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STREAM = '''
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info


class TokenStream(IterableDataset):
    """Windows of a uint16 token file, each rank and worker reading its own (as the review's).

    pause_at: the window number (of this process's reading) before which it waits until the file
    `pause_file` exists: a test acts on a run held there (an event, not a race with its speed)."""

    def __init__(self, path, block_size=32, delay=0.0, pause_at=0, pause_file=""):
        self.path, self.block, self.delay = path, block_size, delay
        self.pause_at, self.pause_file = pause_at, pause_file

    def __iter__(self):
        data = np.memmap(self.path, dtype=np.uint16, mode="r")
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        for n, i in enumerate(range(rank * workers + worker, (len(data) - 1) // self.block, world * workers)):
            if n + 1 == self.pause_at:
                deadline = time.monotonic() + 600
                while not os.path.exists(self.pause_file) and time.monotonic() < deadline:
                    time.sleep(0.02)
            time.sleep(self.delay)
            chunk = torch.from_numpy(data[i * self.block : (i + 1) * self.block + 1].astype(np.int64))
            yield chunk[:-1], chunk[1:]
'''

STEPS = 20
HALF = "checkpoints/step_00000010"  # the mid-run checkpoint of a 20-step run (trainer.ckpt_every=10)
COMMON = (
    "model=gpt",
    "model.dim=32",
    "data.num_classes=64",
    "sched=constant",
    "optim.lr=3e-3",
    "trainer.batch_size=8",
    "trainer.log_every=1",
)
TWO = "nproc_per_node=2"
NOSTATE = ("data.num_workers=0", "data.stateful=false")
BLOCK = 32


@pytest.fixture(scope="module")
def cwd(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cwd = tmp_path_factory.mktemp("streams")
    pattern = np.random.default_rng(0).integers(0, 64, 97)
    tokens = np.tile(pattern, 400).astype(np.uint16)  # 38,800 tokens, learnable
    tokens.tofile(cwd / "tokens.bin")
    other = np.random.default_rng(1).integers(0, 64, 61)
    np.tile(other, 40).astype(np.uint16).tofile(cwd / "other.bin")  # 2,440 tokens: 76 windows
    with (cwd / "rows.jsonl").open("w") as f:  # data=hf: the token file's first 400 windows as rows
        for i in range(400):
            window = tokens[i * BLOCK : (i + 1) * BLOCK + 1].tolist()
            f.write(json.dumps({"input_ids": window[:-1], "labels": window[1:], "i": i}) + "\n")
    return cwd


def _stream(cwd: Path) -> list[str]:
    """The user's stream over the token file, no validation."""
    return [
        "data.train._target_=streamlab.TokenStream",
        f"data.train.path={cwd / 'tokens.bin'}",
        f"data.block_size={BLOCK}",
        "data.val=null",
    ]


def _tokens(cwd: Path) -> list[str]:
    """The built-in data=tokens on the same file: random windows, the tail validates."""
    return ["data=tokens", f"data.path={cwd / 'tokens.bin'}", f"data.block_size={BLOCK}",
            "data.val_fraction=0.1", "trainer.val_batches=3"]  # fmt: skip


def _hf(cwd: Path) -> list[str]:
    """data=hf streaming the JSON lines (split by rank) under FSDP."""
    return ["data=hf", f"data.path={cwd / 'rows.jsonl'}", "data.streaming=true",
            "data.columns=[input_ids,labels]", f"data.num_features={BLOCK}", "task.inputs=input_ids",
            "task.target=labels", "strategy=fsdp"]  # fmt: skip


def _mix(cwd: Path, size: int) -> list[str]:
    """data=mix of 3:1 windows of the two token files, `size` samples an epoch."""

    def source(weight: float, name: str) -> str:
        path = cwd / name
        return f"{{weight: {weight}, _target_: disttrain.data.tokens.load_tokens, path: '{path}', block_size: {BLOCK}}}"

    return ["data=mix", f"data.mix={{a: {source(0.75, 'tokens.bin')}, b: {source(0.25, 'other.bin')}}}",
            f"data.size={size}", f"data.num_features={BLOCK}"]  # fmt: skip


def _user_folder(path: Path) -> Path:
    path.mkdir(exist_ok=True)
    write_module(path, "streamlab", STREAM)
    return path


ONE_EPOCHS = ("trainer.max_steps=-1", "trainer.max_epochs=2")  # 2 epochs of 64 samples: 16 steps of 8


@pytest.fixture(scope="module")
def runs(cwd: Path) -> Runs:
    """Two sweeps: the uninterrupted runs, checkpointed mid-run (a stream without state: at its end,
    in a folder of its own), then the runs resumed from those checkpoints (resume=PATH)."""
    none, stream, steps, half = (
        cwd / "ckpt_none",
        _stream(cwd),
        f"trainer.max_steps={STEPS}",
        "trainer.ckpt_every=10",
    )
    first = {
        # no workers, the position not saved: its final checkpoint is where nostate-rest starts
        "w0": [*stream, TWO, *NOSTATE, steps, f"checkpoint.dir={none}"],
        "w2": [*stream, TWO, "data.num_workers=2", steps, half],
        "tokens": [*_tokens(cwd), TWO, steps, half],
        "hf": [*_hf(cwd), TWO, steps, half],
        "mix": [*_mix(cwd, 256), TWO, steps, half],
        # one rank, counted in epochs, checkpointed at step 6 (6 of the 8 steps of epoch 0)
        "one": [*_mix(cwd, 64), "nproc_per_node=1", *ONE_EPOCHS, "trainer.ckpt_every=6"],
    }  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:  # datasets' cache in the test's folder, never the network
        mp.setenv("HF_DATASETS_CACHE", str(cwd / "hf_cache"))
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        mp.setenv("HF_HUB_OFFLINE", "1")
        runs = run_sweep(_user_folder(cwd / "first"), first, *COMMON)
        rest = {
            "w2-rest": [*stream, TWO, "data.num_workers=2", steps, f"resume={runs['w2'] / HALF}"],
            "nostate-rest": [*stream, TWO, *NOSTATE, f"trainer.max_steps={STEPS + 4}", f"resume={none}"],
            "tokens-rest": [*_tokens(cwd), TWO, steps, f"resume={runs['tokens'] / HALF}"],
            "hf-rest": [*_hf(cwd), TWO, steps, f"resume={runs['hf'] / HALF}"],
            "mix-rest": [*_mix(cwd, 256), TWO, steps, f"resume={runs['mix'] / HALF}"],
            "one-wide": [*_mix(cwd, 64), TWO, *ONE_EPOCHS, f"resume={runs['one'] / 'checkpoints/step_00000006'}"],
        }  # fmt: skip
        resumed = run_sweep(_user_folder(cwd / "rest"), rest, *COMMON)
    return Runs(runs, resumed)


class Runs(Mapping[str, Path]):
    """The runs of both sweeps by name; reading one that did not finish fails only that test."""

    def __init__(self, *sweeps: Sweep) -> None:
        self.sweeps = sweeps

    def _sweep(self, name: str) -> Sweep:
        return next(s for s in self.sweeps if name in list(s))

    def __getitem__(self, name: str) -> Path:
        return self._sweep(name)[name]

    def __iter__(self) -> Iterator[str]:
        return (name for s in self.sweeps for name in s)

    def __len__(self) -> int:
        return sum(len(s) for s in self.sweeps)

    def log(self, name: str) -> str:
        return self._sweep(name).log(name)


def _records(run_dir: Path) -> dict[int, dict[str, Any]]:
    """step -> its training record; a resumed run's metrics.jsonl holds only the steps it trained."""
    records = train_records(run_dir)
    assert len({r["step"] for r in records}) == len(records), "a step was logged twice"
    return {r["step"]: r for r in records}


def _final_meta(run_dir: Path) -> dict[str, Any]:
    ckpts = run_dir / "checkpoints"
    meta: dict[str, Any] = json.loads(
        (ckpts / (ckpts / "latest").read_text().strip() / "meta.json").read_text()
    )
    return meta


@pytest.mark.parametrize("name", ["w0", "w2", "tokens", "hf", "mix"])
def test_a_stream_or_memmap_trains_an_lm_and_its_loss_falls(runs: Runs, name: str) -> None:
    """Each data path trains the GPT: a user stream (0 and 2 workers), data=tokens, data=hf streamed
    under FSDP, data=mix of two token files."""
    losses = train_losses(runs[name])
    assert len(losses) == STEPS
    factor = 0.9 if name == "mix" else 0.8  # a mixture of two patterns: learnt more slowly
    assert sum(losses[-3:]) / 3 < factor * sum(losses[:3]) / 3, losses
    if name == "tokens":  # validated on the held-out tail, 3 batches per rank
        summary = json.loads((runs[name] / "summary.json").read_text())
        assert summary["val/loss"] < losses[0], summary


# (uninterrupted, resumed from its step-10 checkpoint, the metrics that must match besides the loss)
BITWISE = {
    "stream": ("w2", "w2-rest", ()),
    "tokens": ("tokens", "tokens-rest", ()),
    "hf-fsdp": ("hf", "hf-rest", ()),
    "mix": ("mix", "mix-rest", ("data/mix/a", "data/mix/b")),
}


@pytest.mark.parametrize("case", list(BITWISE))
def test_a_run_resumed_mid_epoch_continues_bitwise_like_the_uninterrupted_run(runs: Runs, case: str) -> None:
    """Stopped at step 10 of 20 (mid-epoch: data=tokens' epoch is 75 steps, data=mix's 16) and
    resumed through the CLI on 2 ranks: steps 11..20 have the uninterrupted run's losses (and
    data=mix its per-source counts) bitwise, and the final weights are equal. A user stream with 2
    loader workers, data=tokens (its tail validated at the end: the same val/loss), data=hf streamed
    and split by rank under FSDP (the rank's `datasets` position in StatefulDataLoader's state), and
    a 3:1 data=mix whose second epoch starts at step 17."""
    straight, rest, counts = BITWISE[case]
    log = runs.log(rest)
    assert "resuming from" in log and "will not replay" not in log, log[-2000:]
    a, b = _records(runs[straight]), _records(runs[rest])
    assert sorted(a) == list(range(1, STEPS + 1)) and sorted(b) == list(range(11, STEPS + 1))
    for key in ("train/loss", *counts):
        assert [b[s][key] for s in b] == [a[s][key] for s in b], key
    if counts:  # 16 samples a step, a 3:1 share of them (200 samples: within 0.65..0.85)
        assert b[STEPS]["data/mix/a"] + b[STEPS]["data/mix/b"] == 16 * STEPS
        assert 0.65 < b[STEPS]["data/mix/a"] / (16 * STEPS) < 0.85, b[STEPS]
    _assert_equal(final_weights(runs[rest]), final_weights(runs[straight]))
    summaries = [json.loads((runs[n] / "summary.json").read_text()) for n in (straight, rest)]
    assert summaries[0].get("val/loss") == summaries[1].get("val/loss")


def test_one_rank_resumed_on_two_keeps_the_global_batch_and_ends_like_the_uninterrupted_run(
    runs: Runs,
) -> None:
    """1 -> 2 ranks through the CLI (`train resume=PATH nproc_per_node=2`) from the step-6
    checkpoint of a 1-rank data=mix run of 2 epochs (8 steps of 8 samples each): the batch becomes
    4 a rank (still 8 a step), the run crosses into epoch 1 at step 8 and stops at step 16 after 2
    epochs, as the uninterrupted run did, each step on the same samples (the per-source counts, a
    function of the global order, are equal). The losses match within 1e-5, not bitwise: one rank
    averages 8 per-sample losses, two ranks average 4 each and all-reduce the gradients, so the
    float sums run in another order (last-bit differences, which Adam's normalised steps carry on)."""
    one, wide = runs["one"], runs["one-wide"]
    log = runs.log("one-wide")
    assert "nproc_per_node: 1 -> 2; trainer.batch_size: 8 -> 4" in log, log[-3000:]
    assert "world size 1 -> 2" in log and "global batch 8 -> 8" in log, log[-3000:]
    frozen = read_yaml(wide / "config.yaml")["trainer"]
    assert (frozen["batch_size"], frozen["grad_accum"]) == (4, 1)
    a, b = _records(one), _records(wide)
    assert sorted(a) == list(range(1, 17)) and sorted(b) == list(range(7, 17))
    for key in ("data/mix/a", "data/mix/b"):
        assert [b[s][key] for s in b] == [a[s][key] for s in b], key
    diff = max(abs(a[s]["train/loss"] - b[s]["train/loss"]) for s in b)
    assert diff < 1e-5, {s: (a[s]["train/loss"], b[s]["train/loss"]) for s in b}
    ends = [_final_meta(r) for r in (one, wide)]
    keys = ("step", "epoch", "epoch_samples", "global_batch")
    assert [ends[0][k] for k in keys] == [ends[1][k] for k in keys] == [16, 1, 64, 8], (
        ends
    )  # epoch 1 (from 0) read whole
    summaries = [json.loads((r / "summary.json").read_text()) for r in (one, wide)]
    assert summaries[0]["steps"] == summaries[1]["steps"] == 16, summaries


def test_a_stream_without_its_position_resumes_with_one_warning(runs: Runs) -> None:
    log = (runs["nostate-rest"] / "logs" / "rank0.log").read_text()
    assert log.count("will not replay the same samples") == 1, log[-2000:]
    assert "data.stateful=false" in log
    assert "will not replay" not in runs.log("w0")


def test_a_stream_killed_by_sigkill_restarts_and_ends_bitwise_like_the_uninterrupted_run(
    cwd: Path, runs: Runs
) -> None:
    run_dir, go = cwd / "killed", cwd / "killed_go"
    # Each worker holds before its 6th batch (its 41st window) until `go` exists: the ranks stop at
    # step 11 at the latest, so rank 1 is there to kill however slow the machine (with a 0.12 s step
    # instead, the run had 1.7 s to outrun the test's look-up). The restarted workers count anew
    # and pass with `go` there.
    proc = _start(
        _user_folder(cwd / "killed_cwd"),
        *COMMON,
        *_stream(cwd),
        TWO,
        "data.num_workers=2",
        f"trainer.max_steps={STEPS}",
        "data.train.pause_at=41",
        f"data.train.pause_file={go}",
        "trainer.ckpt_every=4",
        "launcher.max_restarts=1",
        "backend.name=gloo",
        f"hydra.run.dir={run_dir}",
    )
    _wait_for_step(proc, run_dir, 6)
    os.kill(_rank_pid(run_dir, 1), signal.SIGKILL)
    go.touch()
    _, err = _wait(proc, 240)
    assert proc.returncode == 0, err[-3000:]
    log = (run_dir / "logs" / "rank0.log").read_text()
    assert log.count("resuming from") == 1 and "will not replay" not in log
    _assert_equal(final_weights(run_dir), final_weights(runs["w2"]))
    assert not _group_members(proc.pid)


def test_tokens_from_s3_train_with_per_rank_peak_rss_flat_in_object_size(
    tmp_path: Path, s3_bucket: str
) -> None:
    """Issue 38: data=tokens from s3:// on 2 ranks, from a 4 MiB and from a 64 MiB token object
    (the session's S3 server). Each rank reads its windows in ranges, never the object whole: its
    peak resident memory since training started (VmHWM, recorded by the rank in summary.json)
    grows by far less than the 60 MiB between the objects. In process: two runs, ~1 CPU-s each."""
    from disttrain.storage import ObjectPath

    pattern = np.random.default_rng(2).integers(0, 64, 97).astype(np.uint16)
    peaks = {}
    for mib in (4, 64):
        url = f"{s3_bucket}/tokens/{mib}mib.bin"
        ObjectPath(url).write_bytes(np.resize(pattern, mib * 2**20 // 2).tobytes())
        # few windows: the S3 server (moto, in this process) reads the whole object for each ranged GET
        run = ("data=tokens", f"data.path={url}", f"data.block_size={BLOCK}", "trainer.val_batches=1")
        few = ("trainer.max_steps=2", "trainer.batch_size=4")
        _, run_dir = run_cli(tmp_path, *COMMON, *run, *few, TWO, f"hydra.run.dir=r{mib}")
        assert run_dir is not None
        assert len(train_losses(run_dir)) == 2
        peaks[mib] = json.loads((run_dir / "summary.json").read_text())["host_rss_peak_mib_by_rank"]
    assert len(peaks[4]) == len(peaks[64]) == 2 and min(peaks[4]) > 50, peaks  # a rank: torch and more
    grew = max(big - small for small, big in zip(peaks[4], peaks[64], strict=True))
    assert grew < 12, f"a rank's peak RSS grew {grew:.1f} MiB with 60 MiB more object: {peaks}"


def _assert_equal(weights: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert weights.keys() == reference.keys()
    assert all(torch.equal(weights[k], reference[k]) for k in weights), "final weights differ"
