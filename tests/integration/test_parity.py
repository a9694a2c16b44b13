"""Correctness: 2-rank DDP with per-rank batch B matches 1-process `single` with batch 2B.

Same data order, fp32, same seed: every step's loss and grad norm, every validation and the final
weights agree within 1e-5. This holds only if gradients are averaged (not summed) across ranks, the
DistributedSampler splits each global batch between the ranks (and reshuffles per epoch), and
`no_sync` accumulation still all-reduces the sum of all micro-batches on the last one.
The 2-rank ddp runs go through the CLI, as the jobs of one `disttrain train -m` sweep (one start-up
for all: tests/integration/sweep.py); the 1-process `single` reference trains in this process
(conftest.train_in_process: the rank's code at world size 1).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import final_weights, read_yaml, train_in_process, train_records, val_records
from .sweep import Sweep, run_sweep

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TOL = 1e-5
B = 8
# 128 samples: with B=8 per rank and 2 ranks one epoch is 8 micro-batches per rank, so 10 steps cross
# an epoch boundary (twice with grad_accum=2) and exercise set_epoch's reshuffle and the epoch-end
# validation on both sides.
COMMON = (
    "data=synthetic",
    "data.num_samples=128",
    "data.num_val_samples=128",
    "seed=11",
    "sched=constant",
    "trainer.max_steps=10",
    "trainer.log_every=1",
    "model.hidden=[32]",
)
CASES = {
    # id: (optimizer, grad_accum, clip_grad_norm)
    "sgd-noaccum-noclip": ("sgd", 1, "null"),
    "sgd-accum2-clip": ("sgd", 2, "0.5"),  # the clip is below the measured norms: clipping is active
    "adamw-accum2-noclip": ("adamw", 2, "null"),
}


def _shared(optim: str, accum: int, clip: str) -> tuple[str, ...]:
    return (f"optim={optim}", f"trainer.grad_accum={accum}", f"trainer.clip_grad_norm={clip}")


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory: pytest.TempPathFactory) -> Sweep:
    """The 2-rank ddp run of every case: the jobs of one sweep (one parent process and fork server)."""
    ddp = ("strategy=ddp", "nproc_per_node=2", f"trainer.batch_size={B}")
    cases = {name: (*_shared(*case), *ddp) for name, case in CASES.items()}
    return run_sweep(tmp_path_factory.mktemp("ddp"), cases, *COMMON)


@pytest.mark.parametrize("name", list(CASES))
def test_ddp_matches_single_process(tmp_path: Path, name: str, ddp_runs: Sweep) -> None:
    optim, accum, clip = CASES[name]
    ddp = ddp_runs[name]
    single = train_in_process(
        tmp_path / "single",
        *COMMON,
        *_shared(optim, accum, clip),
        "strategy=single",
        "nproc_per_node=1",
        f"trainer.batch_size={2 * B}",
    )
    assert read_yaml(ddp / "env.json")["world_size"] == 2
    assert read_yaml(ddp / "summary.json")["samples"] == read_yaml(single / "summary.json")["samples"]

    a, b = train_records(ddp), train_records(single)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 11))
    assert [r["epoch"] for r in a] == [r["epoch"] for r in b]
    assert a[-1]["epoch"] >= 1, "the runs must cross an epoch boundary"
    for ra, rb in zip(a, b, strict=True):
        assert abs(ra["train/loss"] - rb["train/loss"]) <= TOL, (
            ra["step"],
            ra["train/loss"],
            rb["train/loss"],
        )
        assert abs(ra["grad_norm"] - rb["grad_norm"]) <= TOL * max(1.0, rb["grad_norm"]), ra["step"]

    va, vb = val_records(ddp), val_records(single)
    assert [r["step"] for r in va] == [r["step"] for r in vb] and len(va) >= 2
    for ra, rb in zip(va, vb, strict=True):
        assert abs(ra["val/loss"] - rb["val/loss"]) <= TOL and abs(ra["val/acc"] - rb["val/acc"]) <= TOL

    wa, wb = final_weights(ddp), final_weights(single)
    assert wa.keys() == wb.keys()
    for k in wa:
        diff = (wa[k] - wb[k]).abs().max().item()
        assert diff <= TOL, f"final weight {k} differs by {diff:.3g}"

    # The comparison has teeth: the weights move and the loss falls, so a wrong gradient would show.
    losses = [r["train/loss"] for r in b]
    assert losses[-1] < 0.7 * losses[0], f"the run did not learn: {losses}"
    if clip != "null":
        assert max(r["grad_norm"] for r in b) > float(clip), "clip_grad_norm never clipped"
