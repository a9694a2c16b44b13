"""Model-parallel strategies (pipeline, tp, fsdp+tp) through the real CLI equal `single` (which
trains in the test's own process at world size 1: conftest.train_in_process).

Parity: same seed, data order and global batch. Pipeline and tensor-parallel ranks split one model
and read the SAME data (one data-parallel replica), so they run with the single run's batch 2B;
fsdp+tp on 4 ranks is a (dp=2, tp=2) mesh and runs batch B per replica. Every step's loss and grad
norm (clipping active), each validation and the final weights (consolidated with the original
names) agree within TOL in fp32 (measured: <= 1.2e-7 on losses and grad norms, <= 3.2e-6 on weights
after 20 AdamW steps).

Each CLI run is mostly start-up, so they are the jobs of ONE `disttrain train -m` sweep
(tests/integration/sweep.py: one parent process and fork server for all, every job still a complete
multi-rank run with its own run dir).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from .conftest import final_weights, read_yaml, run_cli, train_in_process, train_records, val_records
from .sweep import Sweep, run_sweep

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]  # the sweep: 5 x JOB_BUDGET

TOL = 1e-5
B = 16
STEPS = 20
COMMON = (
    "data=synthetic",
    "data.num_val_samples=500",  # not a multiple of the batch: the last val batch is short
    "seed=5",
    "sched=constant",
    f"trainer.max_steps={STEPS}",
    "trainer.log_every=1",
    "trainer.val_every=10",
    "trainer.clip_grad_norm=0.1",  # below the measured norms: clipping is active on every step
    "model.hidden=[64,64,64]",  # 8 layers (Flatten, 4 Linear, 3 ReLU): room for 4 stages
)
RUNS: dict[str, tuple[str, ...]] = {
    "single": ("strategy=single", "nproc_per_node=1", f"trainer.batch_size={2 * B}"),
    "tp": ("strategy=tp", f"trainer.batch_size={2 * B}"),
    # gpipe also accumulates: 2 micro-steps of B = the single run's 2B (gradients summed across steps)
    "pipeline-gpipe": (
        "strategy=pipeline",
        "strategy.schedule=gpipe",
        f"trainer.batch_size={B}",
        "trainer.grad_accum=2",
    ),
    # also checkpoints at step 10: test_pipeline_resume continues from there
    "pipeline-1f1b": (
        "strategy=pipeline",
        "strategy.schedule=1f1b",
        f"trainer.batch_size={2 * B}",
        "trainer.ckpt_every=10",
    ),
    "pipeline-interleaved_1f1b": (
        "strategy=pipeline",
        "strategy.schedule=interleaved_1f1b",
        "strategy.stages_per_rank=2",
        f"trainer.batch_size={2 * B}",
    ),
    "fsdp+tp": ("strategy=fsdp+tp", "nproc_per_node=4", f"trainer.batch_size={B}"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Sweep:
    """Every run of RUNS: the CLI runs as the jobs of one sweep (one parent process and fork server
    for all); the 1-process reference trains in this process meanwhile (world size 1)."""
    cli = {name: overrides for name, overrides in RUNS.items() if name != "single"}
    with ThreadPoolExecutor(max_workers=1) as pool:
        swept = pool.submit(run_sweep, tmp_path_factory.mktemp("sweep"), cli, *COMMON)
        single = train_in_process(tmp_path_factory.mktemp("single"), *COMMON, *RUNS["single"])
        sweep = swept.result()
    sweep.add("single", single)
    return sweep


def _max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("name", [n for n in RUNS if n != "single"])
def test_matches_single(runs: Sweep, name: str) -> None:
    got, ref = runs[name], runs["single"]
    assert read_yaml(got / "summary.json")["samples"] == read_yaml(ref / "summary.json")["samples"]
    a, b = train_records(got), train_records(ref)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, STEPS + 1))
    loss = _max_diff([r["train/loss"] for r in a], [r["train/loss"] for r in b])
    norm = _max_diff([r["grad_norm"] for r in a], [r["grad_norm"] for r in b])
    va, vb = val_records(got), val_records(ref)
    assert [r["step"] for r in va] == [r["step"] for r in vb] == [10, 20]
    val = _max_diff([r["val/loss"] for r in va], [r["val/loss"] for r in vb])
    acc = _max_diff([r["val/acc"] for r in va], [r["val/acc"] for r in vb])

    wa, wb = final_weights(got), final_weights(ref)
    assert list(wa) == list(wb), "the consolidated state dict keeps the original names and order"
    weights = max(float((wa[k] - wb[k]).abs().max()) for k in wb)
    print(f"{name}: max |diff| loss {loss:.2e} grad_norm {norm:.2e} val {val:.2e} weights {weights:.2e}")
    assert loss <= TOL and norm <= TOL and val <= TOL and weights <= TOL, (loss, norm, val, weights)
    assert acc == 0.0


def test_pipeline_reports_bubble(runs: Sweep) -> None:
    stats: dict[str, Any] = read_yaml(runs["pipeline-1f1b"] / "summary.json")["pipeline"]
    assert stats["schedule"] == "1f1b" and stats["stages"] == 2 and stats["timed_steps"] == STEPS - 1
    assert stats["bubble_theory"] == pytest.approx(1 / 5)  # (p-1)/(m+p-1), p=2, m=4
    assert all(0.0 <= f < 1.0 for f in stats["idle_fraction_by_rank"])
    inter = read_yaml(runs["pipeline-interleaved_1f1b"] / "summary.json")["pipeline"]
    assert inter["stages"] == 4 and inter["bubble_theory"] == pytest.approx(1 / 9)


def test_pipeline_resume_continues_exactly(runs: Sweep, tmp_path: Path) -> None:
    """The stages' sharded checkpoint (original names, flattened optimizer state) resumes bitwise."""
    first = runs["pipeline-1f1b"]
    ckpt = first / "checkpoints" / "step_00000010"
    _, resumed = run_cli(tmp_path, *COMMON, *RUNS["pipeline-1f1b"], f"resume={ckpt}", timeout=240)
    assert resumed is not None
    a = {r["step"]: r["train/loss"] for r in train_records(first)}
    b = {r["step"]: r["train/loss"] for r in train_records(resumed)}
    assert sorted(b) == list(range(11, STEPS + 1))
    assert all(a[k] == b[k] for k in b), [(k, a[k], b[k]) for k in b if a[k] != b[k]]
