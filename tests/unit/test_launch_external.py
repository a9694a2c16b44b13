"""Ranks an outside launcher started: the local world they are in, who started them, the command."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from unit_support import checked_run

from disttrain.launch import external

LAUNCH_VARS = (
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "PET_NPROC_PER_NODE",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_LOCALID",
    "SLURM_JOB_ID",
    "TORCHELASTIC_RUN_ID",
    "KUBERNETES_SERVICE_HOST",
)


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    for var in [v for v in __import__("os").environ if v.startswith("PET_")]:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")


def test_a_pod_without_local_variables_is_its_own_node(monkeypatch: pytest.MonkeyPatch) -> None:
    external.fill_local_env()
    import os

    assert (os.environ["LOCAL_WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("1", "0")
    assert external.launcher_name() == "env"


def test_kubeflow_processes_per_pod(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    monkeypatch.setenv("PET_NPROC_PER_NODE", "2")
    external.fill_local_env()
    assert (os.environ["LOCAL_WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("2", "1")
    assert external.launcher_name() == "kubeflow"


def test_srun_tasks_per_node(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "2(x2)")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    external.fill_local_env()
    assert (os.environ["LOCAL_WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("2", "1")
    assert external.launcher_name() == "srun"


def test_torchrun_sets_its_own_and_the_command_is_never_main_py(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    external.fill_local_env()
    assert external.launcher_name() == "torchrun"
    monkeypatch.setattr("sys.argv", ["/x/disttrain/__main__.py", "train", "seed=1"])
    command = external.launch_command()  # the parent here is pytest, not a torchrun agent
    assert command[1:] == ["-m", "disttrain", "train", "seed=1"]


def test_launched_shape_is_the_real_world() -> None:
    from disttrain.dist import DistEnv

    env = DistEnv(5, 1, 8, 4, "gloo", __import__("torch").device("cpu"))
    run = checked_run(
        ["nodes=1", "nproc_per_node=2", "node_rank=0", "launcher=torchrun", "launcher.min_nodes=1"]
    )
    shaped = external.launched_shape(run, env)
    world = shaped.world
    assert (world.nodes, world.nproc_per_node, world.node_rank, shaped.launcher.min_nodes) == (2, 4, 1, 0)
    assert (run.world.nodes, run.world.nproc_per_node) == (1, 2)  # a new run: the composed one stays


LAUNCHED_RANK = """
import gc, os, sys
from pathlib import Path
from types import SimpleNamespace

from disttrain import worker
from disttrain.commands.launched import train_as_launched_rank
from disttrain.procs import startup_without_collector

seen, run_dir = Path(sys.argv[1]), sys.argv[2]
os.chdir(seen.parent)
worker.run = lambda run_dir: seen.write_text(f"{gc.isenabled()} {gc.get_freeze_count()}")
startup_without_collector()  # as cli.main leaves it for `train`
args = SimpleNamespace(overrides=["data=synthetic", f"hydra.run.dir={run_dir}"], config_dir=None, config_name=None)
train_as_launched_rank(args)
"""


def test_a_rank_torchrun_started_trains_with_the_garbage_collector_on(tmp_path: Path) -> None:
    """`torchrun -m disttrain train`: each rank is the `disttrain` program, which starts with the
    collector off (`procs.startup_without_collector`) until a launch that such a rank never makes.
    Left off, the whole training would leak every cycle it makes. A process (forked from a server
    that only imported torch: a fork of pytest hung in its first torch op, the intra-op pool's
    threads do not survive a fork) runs the launched rank's flow with the collector off, as
    cli.main leaves it; the rank's training (`worker.run`, a probe here) finds it on, with the
    start-up's objects frozen."""
    import socket

    import forked

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "rank.py").write_text(LAUNCHED_RANK)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "MASTER_"))}
    env.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    seen, err = tmp_path / "gc", tmp_path / "rank.err"
    rank = forked.start(
        tmp_path / "rank.py", [str(seen), str(tmp_path / "run")], env, tmp_path / "rank.out", err
    )
    rank.join(300)
    assert rank.exitcode == 0 and seen.is_file(), (rank.exitcode, err.read_text()[-3000:])
    enabled, frozen = seen.read_text().split()
    assert enabled == "True" and int(frozen) > 10_000, (enabled, frozen)  # torch's objects at least
