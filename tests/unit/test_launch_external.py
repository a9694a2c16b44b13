"""Ranks an outside launcher started: the local world they are in, who started them, the command."""

from __future__ import annotations

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


def test_a_rank_torchrun_started_trains_with_the_garbage_collector_on(tmp_path: Path) -> None:
    """`torchrun -m disttrain train`: each rank is the `disttrain` program, which starts with the
    collector off (`procs.startup_without_collector`) until a launch that such a rank never makes.
    Left off, the whole training would leak every cycle it makes. A child forked from this process
    runs the launched rank's flow with the collector off, as cli.main leaves it; the rank's training
    (`worker.run`, a probe here) finds it on, with the start-up's objects frozen."""
    import gc
    import os
    import socket
    import sys
    from types import SimpleNamespace

    from disttrain import worker
    from disttrain.commands.launched import train_as_launched_rank
    from disttrain.procs import startup_without_collector

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    seen = tmp_path / "gc"
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest (exit_rank ends it)
        code = 1
        try:
            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            os.chdir(tmp_path)
            worker.run = lambda run_dir: seen.write_text(f"{gc.isenabled()} {gc.get_freeze_count()}")  # type: ignore[assignment,misc,return-value]
            startup_without_collector()
            args = SimpleNamespace(
                overrides=["data=synthetic", f"hydra.run.dir={tmp_path / 'run'}"],
                config_dir=None,
                config_name=None,
            )
            train_as_launched_rank(args)
        except BaseException as exc:  # said in the parent's assertion
            sys.stderr.write(f"{exc!r}\n")
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and seen.is_file()
    enabled, frozen = seen.read_text().split()
    assert enabled == "True" and int(frozen) > 10_000, (enabled, frozen)  # torch's objects at least
