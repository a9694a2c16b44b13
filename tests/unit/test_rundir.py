"""The run dir: claimed by one invocation only (D3), reused only with its own config (D18), a
path that can be written (D22), never resumed while its launcher still runs (D3)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from unit_support import checked_run, disttrain_in_process, said

from disttrain import rundir
from disttrain.config.errors import ConfigError
from disttrain.config.run import Run


def _run(changes: dict) -> Run:
    """A checked run with `changes` (the run dir functions take a Run)."""
    return checked_run([]).updated(changes)


def test_claim_gives_a_second_invocation_its_own_dir(tmp_path: Path) -> None:
    wanted = tmp_path / "runs" / "default" / "2026-11-22_19-48-09"
    first = rundir.claim(wanted)
    second = rundir.claim(wanted)  # the same second, the same name
    third = rundir.claim(wanted)
    assert first == wanted
    assert (second.name, third.name) == (f"{wanted.name}-1", f"{wanted.name}-2")
    assert all(p.is_dir() for p in (first, second, third))


def test_claim_refuses_an_unwritable_place(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    for bad in (tmp_path / "file" / "run", Path("/proc/disttrain-test/run")):
        with pytest.raises(ConfigError) as err:
            rundir.claim(bad)
        assert err.value.key == "hydra.run.dir"
    with pytest.raises(ConfigError):
        rundir.claim(tmp_path / "bad\nname")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def _finished_run(tmp_path: Path, cfg: dict, status: str = "finished", pid: int = 0) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    state = {"status": status, "pid": pid or os.getpid() + 1, "host": socket.gethostname()}
    (run / "status.json").write_text(json.dumps(state))
    return run


def test_reuse_refuses_a_finished_run_with_another_config(tmp_path: Path) -> None:
    cfg = _run({"optim": {"lr": 0.003}, "trainer": {"max_steps": 30}, "resume": "auto"})
    run = _finished_run(tmp_path, cfg.to_dict())
    with pytest.raises(ConfigError) as err:
        rundir.reuse(run, cfg.updated({"optim": {"lr": 0.5}}))
    assert err.value.key == "hydra.run.dir" and "optim.lr" in err.value.allowed
    assert "disttrain resume" in err.value.hint
    assert rundir.reuse(run, cfg.updated({"resume": None})) == run, "the same config continues"


def test_running_run_is_refused_only_while_its_launcher_lives(tmp_path: Path) -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        run = _finished_run(tmp_path, _run({"seed": 0}).to_dict(), status="running", pid=sleeper.pid)
        with pytest.raises(ConfigError) as err:
            rundir.refuse_if_running(run, "RUN_DIR")
        assert str(sleeper.pid) in err.value.hint
        with pytest.raises(ConfigError):
            rundir.reuse(run, _run({"seed": 0}))
    finally:
        sleeper.kill()
        sleeper.wait()
    rundir.refuse_if_running(run, "RUN_DIR")  # dead launcher (SIGKILL left `running`): fine


def test_freeze_keeps_the_first_command_and_a_history(tmp_path: Path) -> None:
    rundir.freeze(tmp_path, _run({"seed": 0}), [], ["disttrain", "train", "seed=0"])
    rundir.freeze(tmp_path, _run({"seed": 0}), [], ["disttrain", "resume", str(tmp_path)])
    assert yaml.safe_load((tmp_path / "config.yaml").read_text()) == _run({"seed": 0}).to_dict()
    assert (tmp_path / "command.txt").read_text() == "disttrain train seed=0\n"
    assert (tmp_path / "commands.txt").read_text().splitlines() == [
        "disttrain train seed=0",
        f"disttrain resume {tmp_path}",
    ]


PINNED = "# @package _global_\nhydra:\n  run:\n    dir: runs/pinned\n"


def test_two_invocations_with_the_same_run_dir_get_their_own(scratch: Path) -> None:
    """The `runs/NAME/TIMESTAMP` collision of two runs started in the same second, made certain by
    a config that pins the default run dir: the second gets `-1`, each holds its own config."""
    exp = scratch / "cfgs" / "experiment"
    exp.mkdir(parents=True)
    (exp / "pinned.yaml").write_text(PINNED)
    dry = ("--config-dir", "cfgs", "launcher=slurm", "launcher.dry_run=true", "experiment=pinned")
    for lr in ("0.001", "0.5"):
        proc = disttrain_in_process("train", *dry, f"optim.lr={lr}", cwd=scratch)
        assert proc.returncode == 0, proc.stderr
    runs = scratch / "runs"
    assert sorted(p.name for p in runs.iterdir()) == ["pinned", "pinned-1"]
    lrs = [
        yaml.safe_load((runs / d / "config.yaml").read_text())["optim"]["lr"] for d in ("pinned", "pinned-1")
    ]
    assert lrs == [0.001, 0.5]
    assert "optim.lr=0.5" in (runs / "pinned-1" / "command.txt").read_text()
    assert "hydra.run.dir" not in (runs / "pinned-1" / "command.txt").read_text()


def test_two_sweeps_with_the_same_sweep_dir_get_their_own(scratch: Path) -> None:
    exp = scratch / "cfgs" / "experiment"
    exp.mkdir(parents=True)
    (exp / "pinned.yaml").write_text(PINNED.replace("run:", "sweep:"))
    dry = ("--config-dir", "cfgs", "-m", "launcher=slurm", "launcher.dry_run=true", "experiment=pinned")
    for lrs in ("optim.lr=0.1,0.2", "optim.lr=0.3,0.4"):
        proc = disttrain_in_process("train", *dry, lrs, cwd=scratch)
        assert proc.returncode == 0, proc.stderr
    lr = {
        d: [
            yaml.safe_load((scratch / "runs" / d / job / "config.yaml").read_text())["optim"]["lr"]
            for job in "01"
        ]
        for d in ("pinned", "pinned-1")
    }
    assert lr == {"pinned": [0.1, 0.2], "pinned-1": [0.3, 0.4]}


def test_train_into_a_finished_run_with_another_config_is_refused(scratch: Path) -> None:
    run = scratch / "done"
    dry = ("launcher=slurm", "launcher.dry_run=true", f"hydra.run.dir={run}")
    assert disttrain_in_process("train", *dry, "optim.lr=0.003", cwd=scratch).returncode == 0
    (run / "status.json").write_text(json.dumps({"status": "finished"}))
    before = (run / "config.yaml").read_text()
    proc = disttrain_in_process("train", *dry, "optim.lr=0.5", cwd=scratch)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "config error: hydra.run.dir=" in proc.stderr and "disttrain resume" in proc.stderr
    assert (run / "config.yaml").read_text() == before


def test_unwritable_run_dir_is_one_paragraph(scratch: Path) -> None:
    (scratch / "file").write_text("x")
    for bad in ("/proc/x", "file/run"):
        proc = disttrain_in_process(
            "train", "launcher=slurm", "launcher.dry_run=true", f"hydra.run.dir={bad}", cwd=scratch
        )
        assert proc.returncode == 2, proc.stderr
        assert (
            said(proc.stderr)[0].startswith("disttrain: config error: hydra.run.dir=")
            and "Traceback" not in proc.stderr
        )
    assert [p.name for p in scratch.iterdir()] == ["file"]


def test_a_rank_records_its_dead_launcher_only(tmp_path: Path) -> None:
    """status.json `running` by a launcher that is not this process's parent (it died): interrupted."""
    gone = 2**22 + 1  # a pid that is not our parent
    rundir.write_json(tmp_path / rundir.STATUS, {"status": "running", "pid": gone})
    rundir.record_orphaned(tmp_path, os.getppid(), "x")  # the launcher lives: it writes the status
    assert rundir.read_status(tmp_path) == {"status": "running", "pid": gone}
    rundir.record_orphaned(tmp_path, gone + 1, "x")  # another launcher's run: not ours to end
    assert rundir.read_status(tmp_path)["status"] == "running"
    rundir.record_orphaned(tmp_path, gone, "the ranks stopped at step 3 on the signal")
    status = rundir.read_status(tmp_path)
    assert status["status"] == "interrupted" and status["ended"] > 0
    assert status["error"] == f"the launcher (pid {gone}) died; the ranks stopped at step 3 on the signal"


@pytest.mark.parametrize(
    ("argv0", "expected"),
    [
        ("/venv/bin/disttrain", ["disttrain"]),
        ("/src/disttrain/__main__.py", [Path(sys.executable).name, "-m", "disttrain"]),
        ("-c", ["disttrain"]),  # cli.main called from `python -c`, a notebook or a test harness
        ("", ["disttrain"]),
        ("/venv/lib/python3.11/site-packages/pytest/__main__.py", ["disttrain"]),  # python -m pytest
    ],
)
def test_command_txt_names_the_command_a_shell_would_run(
    argv0: str, expected: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from disttrain.rundir import program

    monkeypatch.setattr(sys, "argv", [argv0, "train"])
    assert program() == expected


def test_d4_relative_paths_are_frozen_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Review 2026-11-28-reliability D4: `checkpoint.dir=ck` and `data.path=tok.bin` were frozen as
    written and read from whatever folder a later export or resume ran in (another run's weights
    exported, a resume that started over or trained on another file)."""
    import numpy as np

    launch = tmp_path / "cwdA"
    launch.mkdir()
    np.arange(4096, dtype=np.uint16).tofile(launch / "tok.bin")
    monkeypatch.chdir(launch)
    tokens = ["data=tokens", "data.path=tok.bin", "data.num_classes=4096", "data.block_size=8"]
    run = checked_run([*tokens, "checkpoint.dir=ck", "init.path=nowhere.pt"])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    rundir.freeze(run_dir, run, [], ["disttrain", "train"])
    monkeypatch.chdir(tmp_path)  # a later command, from elsewhere
    frozen = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert frozen["checkpoint"]["dir"] == str(launch / "ck")
    assert frozen["data"]["path"] == frozen["data"]["train"]["path"] == str(launch / "tok.bin")
    assert frozen["init"]["path"] == "nowhere.pt"  # nothing there: left for the check to name as given
    from disttrain.shared_dir import checkpoint_dir

    assert checkpoint_dir(frozen, run_dir) == launch / "ck"
    from disttrain.config.compose import absolute_paths

    pod = {"launcher": {"name": "k8s"}, "checkpoint": {"dir": "ck"}, "data": {"path": "tok.bin"}}
    absolute_paths(pod)  # a pod resolves them in its own image's file system
    assert pod == {"launcher": {"name": "k8s"}, "checkpoint": {"dir": "ck"}, "data": {"path": "tok.bin"}}
