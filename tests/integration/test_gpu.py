"""Smoke tests on real CUDA GPUs (issue 27): they skip without CUDA (tests/conftest.py's hook) and
run wherever a GPU is present. Marked `gpu`, so the CLI runs here are NOT pinned to gloo
(tests/integration/conftest.py): `backend=auto` becomes nccl and `nproc_per_node=auto` one rank
per GPU, as a user's first run on the machine.

Run them with `python -m pytest tests/integration/test_gpu.py -q` on a CUDA machine; tests that
need two GPUs skip on one.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from .conftest import clean_env, final_weights, read_yaml, run_cli, train_losses, write_module
from .test_batchnorm_and_gather import NET

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(600)]

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
RANKS = max(1, min(GPUS, 2))  # fsdp/DCP runs: two ranks where two GPUs exist
ONE_GPU = {"CUDA_VISIBLE_DEVICES": "0"}
RUN = ("data=synthetic", "trainer.log_every=1")

two_gpus = pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA GPUs")


def _summary(run_dir: Path) -> dict[str, Any]:
    return dict(json.loads((run_dir / "summary.json").read_text()))


def _check_trained(run_dir: Path, steps: int, ranks: int) -> list[float]:
    """nccl ranks, one log record per step with a finite loss, GPU peak memory in summary.json."""
    cfg, env = read_yaml(run_dir / "config.yaml"), read_yaml(run_dir / "env.json")
    assert cfg["nproc_per_node"] == ranks, "auto (or the given number) is frozen as a number"
    assert env["backend"] == "nccl" and env["world_size"] == ranks
    losses = train_losses(run_dir)
    assert len(losses) == steps and all(math.isfinite(x) for x in losses), losses
    summary = _summary(run_dir)
    assert summary["steps"] == steps
    allocated, reserved = summary["gpu_mem_allocated_peak_gib"], summary["gpu_mem_reserved_peak_gib"]
    assert 0 < allocated <= reserved < 100, (allocated, reserved)
    return losses


def test_the_default_command_on_a_one_gpu_machine(tmp_path: Path) -> None:
    """No backend= or nproc_per_node=: auto makes one nccl rank on the one visible GPU, it learns,
    and the one-line summary names its peak GPU memory."""
    proc, run_dir = run_cli(tmp_path, *RUN, "trainer.max_steps=30", env=clean_env(**ONE_GPU))
    assert run_dir is not None
    losses = _check_trained(run_dir, 30, 1)
    assert sum(losses[-5:]) / 5 < 0.9 * sum(losses[:5]) / 5, losses
    assert "peak GPU memory" in proc.stdout
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert all(r["gpu_mem_allocated_peak_gib"] > 0 for r in metrics if "train/loss" in r)


def test_auto_takes_every_visible_gpu(tmp_path: Path) -> None:
    _proc, run_dir = run_cli(tmp_path, *RUN, "trainer.max_steps=4")
    assert run_dir is not None
    _check_trained(run_dir, 4, GPUS)


def test_more_ranks_than_gpus_is_refused_before_any_rank_starts(tmp_path: Path) -> None:
    proc, run_dir = run_cli(tmp_path, *RUN, f"nproc_per_node={GPUS + 1}", expect_rc=2)
    assert run_dir is None and "Traceback" not in proc.stderr
    assert f"nproc_per_node={GPUS + 1} is not valid" in proc.stderr and f"<= {GPUS} " in proc.stderr


def test_fsdp_bf16_two_steps(tmp_path: Path) -> None:
    _proc, run_dir = run_cli(
        tmp_path, *RUN, "strategy=fsdp", "amp=bf16", "trainer.max_steps=2", f"nproc_per_node={RANKS}"
    )
    assert run_dir is not None
    _check_trained(run_dir, 2, RANKS)


def test_compile_on_cuda(tmp_path: Path) -> None:
    """torch.compile through inductor/Triton (needs the host C compiler for Triton's launcher)."""
    _proc, run_dir = run_cli(
        tmp_path, *RUN, "trainer.compile=true", "trainer.max_steps=6", env=clean_env(**ONE_GPU)
    )
    assert run_dir is not None
    _check_trained(run_dir, 6, 1)


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Equal up to float rounding: two GPU runs need not be bitwise equal (kernel choice)."""
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-6) for k in a)


def test_dcp_checkpoints_of_cuda_tensors_save_load_and_async(tmp_path: Path) -> None:
    """FSDP shards (CUDA DTensors) through DCP: a resume from step 4 reloads the weights and ends
    where the uninterrupted run ends; an async save (pinned staging) trains the same numbers."""
    ckpt = ("strategy=fsdp", f"nproc_per_node={RANKS}", "trainer.max_steps=8", "trainer.ckpt_every=4")
    for name in ("straight", "async", "resumed"):
        (tmp_path / name).mkdir()
    _p, straight = run_cli(tmp_path / "straight", *RUN, *ckpt)
    _p, asynchronous = run_cli(tmp_path / "async", *RUN, *ckpt, "checkpoint.async=true")
    assert straight is not None and asynchronous is not None
    step4 = straight / "checkpoints" / "step_00000004"
    assert (step4 / "manifest.json").is_file()
    _p, resumed = run_cli(tmp_path / "resumed", *RUN, *ckpt, f"resume={step4}")
    assert resumed is not None
    a, b, c = (train_losses(r) for r in (straight, resumed, asynchronous))
    assert b == pytest.approx(a[4:], rel=1e-4) and c == pytest.approx(a, rel=1e-4)
    assert _same(final_weights(straight), final_weights(resumed))
    assert _same(final_weights(straight), final_weights(asynchronous))


@two_gpus
def test_dcp_reshard_two_gpus_to_one(tmp_path: Path) -> None:
    ckpt = ("strategy=fsdp", "trainer.max_steps=8", "trainer.ckpt_every=4")
    (tmp_path / "two").mkdir()
    (tmp_path / "one").mkdir()
    _p, two = run_cli(tmp_path / "two", *RUN, *ckpt, "nproc_per_node=2")
    assert two is not None
    step4 = two / "checkpoints" / "step_00000004"
    _p, one = run_cli(tmp_path / "one", *RUN, *ckpt, "nproc_per_node=1", f"resume={step4}")
    assert one is not None
    assert "world size 2 -> 1" in (one / "logs" / "rank0.log").read_text()
    losses = train_losses(one)
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    assert losses[0] == pytest.approx(train_losses(two)[4], rel=0.2)  # the trained weights came back


FORKED = """
import importlib, os, sys
import torch
from disttrain.launch.forkserver import PRELOAD
for name in PRELOAD:  # what the fork server imports before it forks ranks
    importlib.import_module(name)
assert not torch.cuda.is_initialized(), "a preload initialised CUDA: forked ranks cannot use it"
pid = os.fork()
if pid == 0:
    from disttrain.dist import DistEnv
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    env = DistEnv.from_env("auto")  # torch.cuda.set_device in the forked child
    x = torch.ones(1024, device=env.device)
    os._exit(0 if env.backend == "nccl" and float(x.sum()) == 1024.0 else 3)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def test_a_forked_rank_sets_its_device_after_the_fork_servers_preloads(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", FORKED],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_sync_batchnorm_trains_on_cuda(tmp_path: Path) -> None:
    """strategy.sync_batchnorm (review 2026-11-28-real-workloads F8): the user's BatchNorm layers
    become torch's SyncBatchNorm before DDP wraps the model, and the nccl run trains (on CPU ranks
    the key is a config error before launch: test_cli's sync-batchnorm-on-cpu)."""
    write_module(tmp_path, "bnlab", NET)
    net = (
        "model._target_=bnlab.Net",
        "model.in_features=${data.num_features}",
        "model.num_classes=${data.num_classes}",
    )
    _, run_dir = run_cli(tmp_path, *RUN, *net, "strategy=ddp", "strategy.sync_batchnorm=true",
                         f"nproc_per_node={RANKS}", "trainer.max_steps=3")  # fmt: skip
    assert run_dir is not None
    _check_trained(run_dir, 3, RANKS)
    assert (
        "strategy.sync_batchnorm: 1 BatchNorm layer(s) now SyncBatchNorm"
        in (run_dir / "logs" / "rank0.log").read_text()
    )
