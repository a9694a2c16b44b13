"""Determinism across runs, and the already-launched mode (`torchrun ... -m disttrain train`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .conftest import BASELINE, FAST, final_weights, find_run_dirs, read_metrics, read_yaml, run_command

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# What training computes; wall-clock fields (time, samples_per_s, step_time_s, ...) may differ.
DETERMINED = ("step", "epoch", "train/loss", "lr", "grad_norm")


def _numbers(run_dir: Path) -> list[dict[str, object]]:
    """Every loss, lr, grad norm and validation value of metrics.jsonl, by step."""
    return [
        {k: v for k, v in r.items() if k in DETERMINED or k.startswith("val/")} for r in read_metrics(run_dir)
    ]


def _assert_bitwise_equal(a: Path, b: Path) -> None:
    assert _numbers(a) == _numbers(b)
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys()
    unequal = [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert not unequal, f"final weights differ in {unequal}"


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    """The baseline's command under an outside torchrun (`torchrun ... -m disttrain train`): the
    process and the one run dir it made."""
    cwd = tmp_path_factory.mktemp("launched")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--standalone",
        "-m",
        "disttrain",
        "train",
        *FAST,
        *BASELINE,
    ]
    proc = run_command(cmd, cwd, timeout=150)
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = find_run_dirs(cwd)
    assert len(runs) == 1, f"expected exactly one run dir, got {runs}"
    return proc, runs[0]


def test_same_seed_same_threads_is_bitwise_identical(
    launched: tuple[subprocess.CompletedProcess[str], Path],
    baseline: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    """Same seed, threads_per_rank=1, dropout on (per-rank RNG): a second run of the baseline's
    config (here started by an outside torchrun) repeats every bit."""
    _, first = baseline
    _, second = launched
    assert read_yaml(second / "env.json")["threads_per_rank"] == 1
    _assert_bitwise_equal(first, second)
    losses = [r["train/loss"] for r in read_metrics(second) if "train/loss" in r]
    assert len(set(losses)) == len(losses), "the loss must change from step to step"


def test_already_launched_runs_as_those_ranks(
    launched: tuple[subprocess.CompletedProcess[str], Path],
    baseline: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    """Under an outside torchrun the CLI launches nothing: it is a rank; rank 0 freezes ONE run dir."""
    proc, run_dir = launched
    assert {p.name for p in (run_dir / "logs").glob("*.log")} == {"rank0.log", "rank1.log"}
    env = read_yaml(run_dir / "env.json")
    assert env["world_size"] == 2 and env["local_world_size"] == 2 and env["backend"] == "gloo"
    assert "${" not in (run_dir / "config.yaml").read_text()
    assert read_yaml(run_dir / "overrides.yaml") == [*FAST, *BASELINE]
    assert sum(line.startswith("done: 6 steps") for line in proc.stdout.splitlines()) == 1, "rank 0 only"
    # The run record is the real launch: torchrun's command, its world, a status.
    command = (run_dir / "command.txt").read_text()
    assert "torch.distributed.run --nproc-per-node 2" in command and "__main__.py" not in command
    launch = read_yaml(run_dir / "launch.json")
    assert launch["launcher"] == "torchrun" and launch["world_size"] == 2 and launch["nproc_per_node"] == 2
    frozen = read_yaml(run_dir / "config.yaml")
    assert frozen["nproc_per_node"] == 2 and frozen["nodes"] == 1
    assert read_yaml(run_dir / "status.json")["status"] == "finished"
    # The same ranks, the same config: the same run as the one disttrain launched itself.
    _assert_bitwise_equal(baseline[1], run_dir)
