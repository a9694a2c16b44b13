"""Data-parallel strategies (ddp options, zero, fsdp, hsdp, dp, localsgd) through the CLI equal `single`.

Parity: same seed, data order and global batch (2 ranks x B = 1 process x 2B). Every step's loss
and global grad norm, the final validation and the exported weights agree with `single` within TOL
in fp32 (measured: <= 2.4e-7). Clipping is active (CLIP is below the measured norms), so the
sharded-gradient norm and the clipping of DTensor grads under fsdp/hsdp are checked too. Local SGD
clips each rank's LOCAL gradient, which is not what `single` does, so its group runs unclipped with
SGD (linear in the gradient: averaging parameters every step equals averaging gradients).

Memory: summary.json's per-rank bytes of parameters + gradients + optimizer state (local shards).

Each CLI run is mostly start-up (interpreter, torch, compose, fork server), so they are the jobs of
ONE `disttrain train -m` sweep (tests/integration/sweep.py: one start-up for all, every job still a
complete 2-rank run with its own run dir), while the two `single` references train in the test's own
process at world size 1 (no start-up at all).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from .conftest import (
    CLI,
    cli_in_process,
    final_weights,
    run_cli,
    run_command,
    train_in_process,
    train_records,
    val_records,
)
from .sweep import Sweep, run_sweep

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # the sweep: 9 x JOB_BUDGET, + the resume (300)

TOL = 1e-5  # fp32, same reduction order up to the all-reduce: measured <= 2.4e-7
FP16_TOL = 1e-3  # gradients sent as fp16 (comm_hook=fp16): measured
FP16_WEIGHT_TOL = 1e-2  # ... 3.4e-4 on the loss, 4.2e-3 on the weights after 20 SGD-momentum steps
W, B, STEPS, CLIP = 2, 8, 20, 0.5
HIDDEN = [64, 64, 64]  # 4 Linear layers: fsdp units, and a ZeRO partition that is roughly even
COMMON = (
    "data=synthetic",
    "data.noise=3",  # a task that is not solved in 5 steps, so the trajectories stay informative
    "sched=constant",
    f"trainer.max_steps={STEPS}",
    "trainer.log_every=1",
    "trainer.val_every=10",
    f"model.hidden=[{','.join(map(str, HIDDEN))}]",
)
ADAM = (f"trainer.clip_grad_norm={CLIP}",)
SGD = ("optim=sgd", "trainer.clip_grad_norm=null")
ONE = ("nproc_per_node=1", f"trainer.batch_size={W * B}")
TWO = (f"nproc_per_node={W}", f"trainer.batch_size={B}")
LOCALSGD_WARMUP, LOCALSGD_EVERY = 4, 4

RUNS: dict[str, tuple[str, ...]] = {
    # AdamW, clipping active
    "single": (*ADAM, "strategy=single", *ONE),
    "ddp": (
        *ADAM,
        "strategy=ddp",
        *TWO,
        "strategy.bucket_cap_mb=0.005",  # several buckets for a 40 KB model
        "strategy.static_graph=true",
        "strategy.gradient_as_bucket_view=true",
    ),
    "zero": (*ADAM, "strategy=zero", *TWO, "strategy.parameters_as_bucket_view=true"),
    # ckpt_every: a mid-run checkpoint for `disttrain eval CHECKPOINT` (test_eval_*)
    "fsdp": (*ADAM, "strategy=fsdp", *TWO, "strategy.wrap_classes=[Linear]", "trainer.ckpt_every=10"),
    "zero2": (*ADAM, "strategy=zero2", *TWO, "strategy.wrap_classes=[Linear]"),  # FSDP2, no reshard
    # replicate=2 on 2 ranks: mesh (2, 1); the default units: the repeated block of the MLP's
    # Sequential, its 4 Linear layers (test_engine_depth's 1-block gpt covers the size policy)
    "hsdp": (*ADAM, "strategy=hsdp", *TWO, "strategy.reshard_after_forward=false"),
    "dp": (*ADAM, "strategy=dp", *ONE),
    # SGD + momentum, no clipping
    "single_sgd": (*SGD, "strategy=single", *ONE),
    "ddp_fp16": (
        *SGD,
        "strategy=ddp",
        *TWO,
        "strategy.comm_hook=fp16",
        "strategy.find_unused_parameters=true",
    ),
    "localsgd_1": (*SGD, "strategy=localsgd", *TWO, "strategy.sync_every=1", "strategy.warmup_steps=0"),
    "localsgd_n": (
        *SGD,
        "strategy=localsgd",
        *TWO,
        f"strategy.sync_every={LOCALSGD_EVERY}",
        f"strategy.warmup_steps={LOCALSGD_WARMUP}",
        "trainer.ckpt_every=8",
    ),
}
PARITY = {  # run: (baseline, tolerance on losses and norms, tolerance on the final weights)
    "ddp": ("single", TOL, TOL),
    "zero": ("single", TOL, TOL),
    "fsdp": ("single", TOL, TOL),
    "zero2": ("single", TOL, TOL),
    "hsdp": ("single", TOL, TOL),
    "dp": ("single", TOL, TOL),
    "localsgd_1": ("single_sgd", TOL, TOL),
    "ddp_fp16": ("single_sgd", FP16_TOL, FP16_WEIGHT_TOL),
}
# The `single` references train in this process (conftest.train_in_process: the rank's code at world
# size 1); every run compared against them is a real CLI run.
IN_PROCESS = ("single", "single_sgd")
RESUME_AT = 8  # localsgd_n also resumes from its step-8 checkpoint: mid-way between two averages


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Sweep:
    """Every run of RUNS: the CLI runs as the jobs of one sweep (one parent process and fork server
    for all), localsgd_n's resume after it; the two references train in this process meanwhile."""
    cli = sorted((n for n in RUNS if n not in IN_PROCESS), key=lambda n: n != "localsgd_n")
    with ThreadPoolExecutor(max_workers=1) as pool:
        swept = pool.submit(run_sweep, tmp_path_factory.mktemp("sweep"), {n: RUNS[n] for n in cli}, *COMMON)
        # The 1-process references train here meanwhile (this thread only waits on the sweep).
        done = {
            name: train_in_process(tmp_path_factory.mktemp(name), *COMMON, *RUNS[name]) for name in IN_PROCESS
        }
        sweep = swept.result()
    for name, run_dir in done.items():
        sweep.add(name, run_dir)
    if sweep.finished("localsgd_n"):  # else reading either fails naming localsgd_n's job
        first = sweep["localsgd_n"] / "checkpoints" / f"step_{RESUME_AT:08d}"
        folder = tmp_path_factory.mktemp("localsgd_resumed")
        _, resumed = run_cli(folder, *COMMON, *RUNS["localsgd_n"], f"resume={first}", timeout=300)
        assert resumed is not None
        sweep.add("localsgd_resumed", resumed)
    return sweep


def summary(run_dir: Path) -> dict[str, Any]:
    return dict(json.loads((run_dir / "summary.json").read_text()))


# ---------------------------------------------------------------------------------------- parity
@pytest.mark.parametrize("name", list(PARITY))
def test_matches_single(runs: Sweep, name: str) -> None:
    base, tol, weight_tol = PARITY[name]
    a, b = train_records(runs[name]), train_records(runs[base])
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, STEPS + 1))
    for ra, rb in zip(a, b, strict=True):
        assert ra["train/loss"] == pytest.approx(rb["train/loss"], abs=tol), (name, ra["step"])
        if not name.startswith("localsgd"):  # local SGD reports rank 0's LOCAL gradient norm
            norm = pytest.approx(rb["grad_norm"], abs=10 * tol, rel=tol)
            assert ra["grad_norm"] == norm, (name, ra["step"])
    va, vb = val_records(runs[name])[-1], val_records(runs[base])[-1]
    assert va["val/loss"] == pytest.approx(vb["val/loss"], abs=tol)
    assert va["val/acc"] == pytest.approx(vb["val/acc"], abs=1e-9 if tol == TOL else 2e-3)
    wa, wb = final_weights(runs[name]), final_weights(runs[base])
    assert sorted(wa) == sorted(wb), "exported names must be the plain model's (no module./FSDP prefixes)"
    for key in wa:
        assert tuple(wa[key].shape) == tuple(wb[key].shape), key
        assert (wa[key] - wb[key]).abs().max().item() <= weight_tol, key


def test_clipping_was_active(runs: Sweep) -> None:
    norms = [r["grad_norm"] for r in train_records(runs["single"])]
    assert sum(n > CLIP for n in norms) >= STEPS // 2, f"CLIP={CLIP} clipped too few steps: {norms}"


def test_every_run_completed(runs: Sweep) -> None:
    for name, run_dir in runs.items():
        s = summary(run_dir)
        assert s["steps"] == STEPS, name
        assert (run_dir / "checkpoints" / "final.pt").is_file(), name
        world = 1 if "nproc_per_node=1" in RUNS.get(name, ()) else W
        assert len(s["state_bytes_by_rank"]) == world, name


def test_fsdp_wrapping_and_mesh(runs: Sweep) -> None:
    assert "fsdp: mesh (2,), root + 4 wrapped units (Linear)" in runs.log("fsdp")
    assert "fsdp: mesh (2, 1), root + 4 wrapped units (Linear)" in runs.log("hsdp")


def test_dp_on_cpu_says_so_once(runs: Sweep) -> None:
    # dp is the sweep's only strategy=dp job: once on the sweep's console, once in its rank log
    assert runs.output.count("strategy=dp: no CUDA GPUs") == 1, runs.output[-2000:]
    assert runs.log("dp").count("strategy=dp: no CUDA GPUs") == 1, runs.log("dp")[-2000:]


# ---------------------------------------------------------------------------------------- memory
def test_fsdp_holds_one_shard_per_rank(runs: Sweep) -> None:
    """fsdp: params + grads + AdamW state per rank <= ddp's / W + 1% (per-tensor step counters and
    dim-0 padding are the only extra); hsdp on (2, 1) replicates, so it holds what ddp holds."""
    ddp = summary(runs["ddp"])["state_bytes_by_rank"]
    assert ddp == [summary(runs["single"])["state_bytes_per_rank"]] * W
    fsdp = summary(runs["fsdp"])["state_bytes_by_rank"]
    for rank_bytes in fsdp:
        assert rank_bytes <= ddp[0] / W * 1.01, (fsdp, ddp)
    assert sum(fsdp) >= ddp[0], "the shards together hold the whole model"
    hsdp = summary(runs["hsdp"])["state_bytes_by_rank"]
    assert all(abs(h - ddp[0]) <= 0.01 * ddp[0] for h in hsdp), (hsdp, ddp)


def test_zero_partitions_optimizer_state(runs: Sweep) -> None:
    """ZeRO-1 shards only the optimizer state, by whole tensors (greedy by size): each rank holds
    <= ddp's optimizer bytes / W + the largest tensor's state, none of it twice; params and grads
    stay full (that is ZeRO-1, not ZeRO-3: fsdp above shards those)."""
    ddp = summary(runs["ddp"])["state_bytes_detail_by_rank"][0]
    zero = summary(runs["zero"])["state_bytes_detail_by_rank"]
    # AdamW's exp_avg + exp_avg_sq of the largest (64x64) weight, and its step counter
    largest_state = 2 * max(HIDDEN) * max(HIDDEN) * 4 + 4
    for rank in zero:
        assert rank["params"] == ddp["params"] and rank["grads"] == ddp["grads"]
        assert rank["optimizer"] <= ddp["optimizer"] / W + largest_state, (zero, ddp)
        assert rank["optimizer"] < ddp["optimizer"]
    assert sum(r["optimizer"] for r in zero) == ddp["optimizer"], "each tensor's state lives on one rank"


# ---------------------------------------------------------------------------------------- local SGD
def test_localsgd_bytes_fall_by_sync_every(runs: Sweep) -> None:
    """Bytes all-reduced, counted in the comm hook (gradients) and the averager (parameters)."""
    param_bytes = summary(runs["ddp"])["state_bytes_detail_by_rank"][0]["params"]
    every = summary(runs["localsgd_1"])["allreduce_bytes"]
    assert every == {"grads": 0, "params": STEPS * param_bytes, "total": STEPS * param_bytes}
    n = summary(runs["localsgd_n"])["allreduce_bytes"]
    averages = len(range(LOCALSGD_WARMUP, STEPS, LOCALSGD_EVERY))
    assert n["grads"] == LOCALSGD_WARMUP * param_bytes  # plain DDP steps first
    assert n["params"] == (averages + 1) * param_bytes  # + the final average (step 20 is not due)
    after_warmup = (n["params"] - param_bytes) / (STEPS - LOCALSGD_WARMUP)
    assert after_warmup == pytest.approx(param_bytes / LOCALSGD_EVERY)  # ~N times fewer bytes per step


def _replicas(ckpt: Path, tmp_path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Rank 0's and rank 1's model from a localsgd DCP checkpoint (rank 1 saves under `rank1/`)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(ckpt, tmp_path / f"{ckpt.name}.pt")
    state = torch.load(tmp_path / f"{ckpt.name}.pt", weights_only=False)
    return state["model"], state["rank1"]["model"]


def test_localsgd_ends_with_the_average_of_the_replicas(runs: Sweep, tmp_path: Path) -> None:
    """Replicas drift between averages (step 8 is not an averaging step); the last step is not one
    either, yet the final checkpoint and final.pt hold one model: the replicas' average."""
    import torch

    ckpts = runs["localsgd_n"] / "checkpoints"
    mid0, mid1 = _replicas(ckpts / "step_00000008", tmp_path)
    assert max((mid0[k] - mid1[k]).abs().max().item() for k in mid0) > 1e-4, "replicas differ mid-way"
    end0, end1 = _replicas(ckpts / f"step_{STEPS:08d}", tmp_path)
    final = torch.load(ckpts / "final.pt", weights_only=True)["model"]
    for k in end0:
        assert torch.equal(end0[k], end1[k]) and torch.equal(final[k], end0[k]), k


def test_localsgd_still_learns(runs: Sweep) -> None:
    first = train_records(runs["localsgd_n"])[0]["train/loss"]
    final, ref = val_records(runs["localsgd_n"])[-1], val_records(runs["single_sgd"])[-1]
    assert final["val/loss"] < 0.5 * first
    assert final["val/loss"] <= 1.5 * ref["val/loss"] + 0.05, (final, ref)
    assert final["val/acc"] >= ref["val/acc"] - 0.05


def test_localsgd_resumes_exactly(runs: Sweep) -> None:
    """Replicas differ between averages; each rank's own state must come back, not one copy."""
    resumed = {r["step"]: r["train/loss"] for r in train_records(runs["localsgd_resumed"])}
    original = {r["step"]: r["train/loss"] for r in train_records(runs["localsgd_n"])}
    assert sorted(resumed) == list(range(RESUME_AT + 1, STEPS + 1))
    for step, loss in resumed.items():
        assert loss == pytest.approx(original[step], abs=TOL), step


# ---------------------------------------------------------------------------------- eval, predict
EVAL_TOL = 1e-6  # the same float64 sums over other batches: measured 3.7e-9 (1 rank), 0 (2 ranks)


def _eval(args: list[str], cwd: Path, in_process: bool) -> dict[str, Any]:
    """`disttrain eval ARGS` (in this process at world size 1, else a real CLI launch): eval.json."""
    out = cwd / f"eval-{len(list(cwd.glob('eval-*.json')))}.json"
    cmd = ["eval", *args, "--out", str(out), "threads_per_rank=1"]
    proc = cli_in_process(*cmd, cwd=cwd) if in_process else run_command([CLI, *cmd], cwd, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f"-> {out}" in proc.stdout
    return dict(json.loads(out.read_text()))


def test_eval_reproduces_the_final_val_loss_at_any_world_size(runs: Sweep, tmp_path: Path) -> None:
    """A finished 2-rank fsdp run evaluated on 1 rank (in process) and on 2 ranks (CLI): the final
    val/loss and val/acc to 1e-6, from the final checkpoint; a named mid-run checkpoint gives that
    step's validation and leaves the run's later checkpoints and config as they were."""
    run = runs["fsdp"]
    final = summary(run)
    config = (run / "config.yaml").read_bytes()
    for world, in_process in ((1, True), (2, False)):
        result = _eval([str(run), f"nproc_per_node={world}"], tmp_path, in_process)
        assert (result["step"], result["world_size"]) == (STEPS, world)
        for key in ("val/loss", "val/acc"):
            assert result["metrics"][key] == pytest.approx(final[key], abs=EVAL_TOL), (world, key)
    mid = run / "checkpoints" / "step_00000010"
    result = _eval([str(mid), "nproc_per_node=1"], tmp_path, in_process=True)
    at_10 = next(r for r in val_records(run) if r["step"] == 10)
    assert result["step"] == 10 and result["checkpoint"] == str(mid)
    assert result["metrics"]["val/loss"] == pytest.approx(at_10["val/loss"], abs=EVAL_TOL)
    assert (run / "checkpoints" / f"step_{STEPS:08d}").is_dir(), "eval moved a later checkpoint aside"
    assert (run / "config.yaml").read_bytes() == config


def test_predict_writes_one_row_per_sample_in_dataset_order(runs: Sweep, tmp_path: Path) -> None:
    """101 validation samples on 2 ranks (shards of 51 and 50): exactly 101 rows, indices 0..100,
    each the output of the final model on that sample (the exported final.pt run in this process)."""
    import torch

    from disttrain.data import build_datasets
    from disttrain.models import build_model
    from disttrain.rundir import read_config

    run, n = runs["fsdp"], 101
    out = tmp_path / "preds.jsonl"
    cmd = ["predict", str(run), "--out", str(out), f"data.val.num_samples={n}", "threads_per_rank=1"]
    proc = cli_in_process(*cmd, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"predict: {n} rows from step_" in proc.stdout and f" -> {out}" in proc.stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in rows] == list(range(n))
    cfg = read_config(run)
    cfg["data"]["val"]["num_samples"] = n
    _, val = build_datasets(cfg["data"])
    model = build_model(cfg["model"])
    model.load_state_dict(final_weights(run))
    with torch.no_grad():
        expected = model(torch.stack([val[i][0] for i in range(n)]))
    got = torch.tensor([r["output"] for r in rows])
    assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()
