"""End to end through the real CLI, both launchers, 2 gloo ranks: the run dir is complete and right."""

from __future__ import annotations

import math
import re
import subprocess
from pathlib import Path

import pytest
import torch

from .conftest import (
    BASELINE,
    final_weights,
    init_git_repo,
    read_metrics,
    read_yaml,
    run_cli,
    train_records,
    val_records,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STEPS, BATCH, WORLD = 6, 32, 2  # QUICK: trainer.max_steps=6, the default per-rank batch 32, 2 ranks
TB_TAGS = {"train/loss", "val/loss", "val/acc", "lr", "grad_norm", "samples_per_s"}
STAMP = re.compile(r"^\d\d-\d\d-\d\d-\d{6}$")


@pytest.fixture(scope="module")
def spawn_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    """The baseline's config under launcher=spawn, plus a `${now:}` key that must be frozen once."""
    cwd = tmp_path_factory.mktemp("spawn")
    init_git_repo(cwd)
    # `name` is a key the run reads (its run dir); a made-up top-level +key is refused (review D20)
    proc, run_dir = run_cli(cwd, "launcher=spawn", *BASELINE, "name=${now:%H-%M-%S-%f}")
    assert run_dir is not None
    return proc, run_dir


@pytest.fixture(params=["torchrun", "spawn"])
def launched(request: pytest.FixtureRequest) -> tuple[str, subprocess.CompletedProcess[str], Path]:
    fixture = "baseline" if request.param == "torchrun" else "spawn_run"
    proc, run_dir = request.getfixturevalue(fixture)
    return request.param, proc, run_dir


def test_frozen_files(launched: tuple[str, subprocess.CompletedProcess[str], Path]) -> None:
    launcher, proc, run_dir = launched
    text = (run_dir / "config.yaml").read_text()
    assert "${" not in text, "config.yaml must be fully resolved"
    cfg = read_yaml(run_dir / "config.yaml")
    assert cfg["launcher"]["name"] == launcher
    assert cfg["trainer"]["max_steps"] == STEPS and cfg["seed"] == 5 and cfg["model"]["dropout"] == 0.1
    assert cfg["data"]["name"] == "synthetic" and cfg["data"]["train"]["num_features"] == 32  # interpolated
    assert cfg["model"]["in_features"] == 32 and cfg["model"]["num_classes"] == 4
    assert cfg["nproc_per_node"] == WORLD and cfg["threads_per_rank"] == 1

    overrides = read_yaml(run_dir / "overrides.yaml")
    assert f"launcher={launcher}" in overrides and "trainer.max_steps=6" in overrides
    assert "threads_per_rank=1" in overrides

    command = (run_dir / "command.txt").read_text().strip()
    assert command.startswith("disttrain train "), command
    assert not (run_dir / ".hydra").exists()  # one run: the checked job, not @hydra.main's composition
    assert f"launcher={launcher}" in command and "trainer.max_steps=6" in command

    git = read_yaml(run_dir / "git.json")  # JSON is YAML
    cwd = run_dir.parents[2]  # <cwd>/runs/default/<timestamp>
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, check=True)
    assert git["sha"] == head.stdout.strip()
    assert git["dirty"] is False  # run dirs are untracked files; the tracked tree is clean
    assert Path(git["repo"]).resolve() == cwd.resolve()

    env = read_yaml(run_dir / "env.json")
    assert env["world_size"] == WORLD and env["backend"] == "gloo"
    assert env["local_world_size"] == WORLD and env["threads_per_rank"] == 1
    assert len(env["hosts"]) == WORLD

    logs = {p.name: p.read_text() for p in (run_dir / "logs").glob("*.log")}
    assert set(logs) == {"rank0.log", "rank1.log"}
    assert "rank 0 of 2" in logs["rank0.log"]
    assert all(f"step {STEPS} val:" in text for text in logs.values()), "every rank logs to its own file"

    assert str(run_dir) in proc.stdout.splitlines()[-1], "the last line is the summary naming the run dir"
    assert proc.stdout.splitlines()[-1].startswith(f"done: {STEPS} steps")


def test_metrics_and_summary(launched: tuple[str, subprocess.CompletedProcess[str], Path]) -> None:
    _, _, run_dir = launched
    train = train_records(run_dir)
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))  # trainer.log_every=1
    for r in train:
        assert math.isfinite(r["train/loss"]) and r["train/loss"] > 0
        assert math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0
        assert r["samples_per_s"] > 0
    # The default cosine schedule is in its linear warm-up: step s ran at lr x s / warmup_steps.
    cfg = read_yaml(run_dir / "config.yaml")
    base, warmup = cfg["optim"]["lr"], cfg["sched"]["warmup_steps"]
    assert cfg["sched"]["name"] == "cosine" and warmup > STEPS
    assert [r["lr"] for r in train] == pytest.approx(
        [base * s / warmup for s in range(1, STEPS + 1)], rel=1e-9
    )
    losses = [r["train/loss"] for r in train]
    assert losses[-1] < losses[0], f"the run does not learn: {losses}"

    val = val_records(run_dir)
    assert [r["step"] for r in val] == [STEPS], "one validation, at the end (max_steps inside epoch 0)"
    assert val[0]["val/loss"] > 0 and 0.3 < val[0]["val/acc"] <= 1.0  # 4 classes: chance is 0.25
    # Accuracy is a count over the whole val set (512 samples), reduced across both ranks.
    assert abs(val[0]["val/acc"] * 512 - round(val[0]["val/acc"] * 512)) < 1e-6

    summary = read_yaml(run_dir / "summary.json")
    assert summary["steps"] == STEPS and summary["samples"] == STEPS * BATCH * WORLD
    assert summary["val/loss"] == pytest.approx(val[-1]["val/loss"], abs=1e-12)
    assert summary["val/acc"] == pytest.approx(val[-1]["val/acc"], abs=1e-12)

    state = torch.load(run_dir / "checkpoints" / "final.pt", map_location="cpu", weights_only=True)
    assert state["step"] == STEPS
    shapes = {k: tuple(v.shape) for k, v in state["model"].items()}
    assert shapes == {
        "layers.1.weight": (128, 32),
        "layers.1.bias": (128,),
        "layers.4.weight": (128, 128),
        "layers.4.bias": (128,),
        "layers.7.weight": (4, 128),
        "layers.7.bias": (4,),
    }, shapes  # the unwrapped MLP (hidden [128, 128], dropout layers between): no DDP "module." prefix


def test_tensorboard_events(launched: tuple[str, subprocess.CompletedProcess[str], Path]) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, _, run_dir = launched
    events = list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1, "only rank 0 writes TensorBoard"
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) >= TB_TAGS
    train = train_records(run_dir)
    tb_loss = acc.Scalars("train/loss")
    assert [e.step for e in tb_loss] == [r["step"] for r in train]
    assert [e.value for e in tb_loss] == pytest.approx([r["train/loss"] for r in train], rel=1e-6)
    assert [e.step for e in acc.Scalars("val/acc")] == [STEPS]


def test_launchers_agree(
    baseline: tuple[subprocess.CompletedProcess[str], Path],
    spawn_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    """torchrun and spawn start the same worker: same config and seed give bitwise-identical runs."""
    a, b = baseline[1], spawn_run[1]
    keep = ("step", "epoch", "train/loss", "lr", "grad_norm", "val/loss", "val/acc")  # not wall-clock fields
    rec_a = [{k: v for k, v in r.items() if k in keep} for r in read_metrics(a)]
    rec_b = [{k: v for k, v in r.items() if k in keep} for r in read_metrics(b)]
    assert rec_a == rec_b and len(rec_a) == STEPS + 1
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_now_resolved_once(spawn_run: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    _, run_dir = spawn_run
    stamp = read_yaml(run_dir / "config.yaml")["name"]
    assert isinstance(stamp, str) and STAMP.match(stamp), f"stamp {stamp!r} is not one concrete time"
    assert (run_dir / "config.yaml").read_text().count(stamp) == 1


def test_runs_through_one_fork_server_each_write_where_their_launcher_writes(tmp_path: Path) -> None:
    """LauncherStdio: one process launching runs one after the other through its one fork server
    (these runs are in the pytest worker, as a sweep's jobs are in the CLI), each run's rank 0
    writes to the stderr its launcher had at that launch, not to the server's (the first run's)."""
    from multiprocessing import forkserver

    servers = []
    for name, launcher in (("one", "torchrun"), ("two", "spawn"), ("three", "torchrun")):
        (tmp_path / name).mkdir()
        proc, run_dir = run_cli(
            tmp_path / name, "data=synthetic", "trainer.max_steps=2", f"launcher={launcher}"
        )
        assert run_dir is not None
        ours = [line for line in proc.stderr.splitlines() if line.startswith("[disttrain] rank 0 of 2 ")]
        assert len(ours) == 1 and ours[0].endswith(f"run dir {run_dir}"), proc.stderr[-2000:]
        assert "step 2 val:" in proc.stderr, proc.stderr[-2000:]
        servers.append(getattr(forkserver._forkserver, "_forkserver_pid", None))
    assert servers[0] is not None and len(set(servers)) == 1, f"one server served the three runs: {servers}"
