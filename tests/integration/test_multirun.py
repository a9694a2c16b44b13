"""`disttrain train -m a=1,2`: one complete, fully launched 2-rank run per value, in one sweep dir."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from .conftest import FAST, QUICK, cli_in_process, find_run_dirs, read_yaml, train_losses

pytestmark = [pytest.mark.slow, pytest.mark.timeout(360)]

LRS = (1e-3, 1e-2)


def test_sweep_gives_one_complete_run_per_value(tmp_path: Path) -> None:
    # hydra.sweep.subdir evaluated per job, as Hydra's launcher evaluates it (job number, job config)
    subdir = "hydra.sweep.subdir=lr${optim.lr}_${hydra.job.num}"
    cmd = ["train", "-m", f"optim.lr={LRS[0]},{LRS[1]}", *FAST, *QUICK, "sched=constant", subdir]
    proc = cli_in_process(*cmd, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]

    runs = find_run_dirs(tmp_path)
    assert [d.name for d in runs] == [f"lr{LRS[0]}_0", f"lr{LRS[1]}_1"], runs
    sweep = runs[0].parent
    assert runs[1].parent == sweep and sweep.name.startswith("multirun_"), sweep
    assert sum(line.startswith("done: 6 steps") for line in proc.stdout.splitlines()) == 2

    for run_dir, lr in zip(runs, LRS, strict=True):
        cfg = read_yaml(run_dir / "config.yaml")
        assert cfg["optim"]["lr"] == lr and cfg["trainer"]["max_steps"] == 6
        assert f"optim.lr={lr}" in read_yaml(run_dir / "overrides.yaml")
        assert "${" not in (run_dir / "config.yaml").read_text()
        env = read_yaml(run_dir / "env.json")
        assert env["world_size"] == 2 and env["backend"] == "gloo"
        assert {p.name for p in (run_dir / "logs").glob("*.log")} == {"rank0.log", "rank1.log"}
        assert read_yaml(run_dir / "summary.json")["steps"] == 6
        assert (run_dir / "checkpoints" / "final.pt").is_file()
        assert len(train_losses(run_dir)) == 6
        assert (run_dir / "tensorboard").is_dir()
        # a basic sweep's jobs run without @hydra.main (whose job runner writes .hydra/ into each);
        # each job's command.txt is the sweep's command, with the sweep dir it claimed
        assert not (run_dir / ".hydra").exists()
        command = shlex.split((run_dir / "command.txt").read_text())
        assert command[1:3] == ["train", "-m"] and f"hydra.sweep.dir='{sweep}'" in command, command

    # Both jobs start from the same weights and batch (step 1's loss is taken before any update);
    # after that the lr shows: each job ran its own config.
    slow, fast = (train_losses(d) for d in runs)
    assert slow[0] == pytest.approx(fast[0], abs=1e-6)
    assert abs(slow[-1] - fast[-1]) > 1e-3 and fast[-1] < slow[-1], (slow, fast)
