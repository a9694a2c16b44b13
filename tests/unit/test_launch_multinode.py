"""Multi-node and SLURM pieces that need no second machine: checks, hashes, the sbatch script."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from unit_support import checked_run, disttrain_in_process

from disttrain.config.errors import ConfigError
from disttrain.config.run import Run
from disttrain.launch import multinode, slurm

MULTI = ("nodes=2", "master_addr=10.1.2.3")


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (("launcher.min_nodes=3",), "launcher.min_nodes"),
        (("launcher.min_nodes=-1",), "launcher.min_nodes"),
        (("launcher.rdzv_timeout=0",), "launcher.rdzv_timeout"),
        (("launcher.rdzv_last_call=0",), "launcher.rdzv_last_call"),
        (("master_port=70000",), "master_port"),
        (("launcher=slurm", "launcher.time=soon"), "launcher.time"),
        (("launcher=slurm", "launcher.gpus_per_node=-1"), "launcher.gpus_per_node"),
        (("launcher=slurm", "launcher.partition=a b"), "launcher.partition"),
        (("launcher=slurm", "launcher.extra=[--exclusive]"), "launcher.extra"),
    ],
)
def test_bad_launch_settings_fail_before_launch(overrides: tuple[str, ...], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        checked_run([*MULTI, *overrides])
    assert info.value.key == key


def test_elastic_range_and_slurm_settings_are_accepted() -> None:
    cfg = checked_run([*MULTI, "launcher.min_nodes=1", "launcher=slurm", "launcher.time=1-00:00:00"])
    assert cfg.launcher.min_nodes == 1 and cfg.launcher.time == "1-00:00:00"


@pytest.mark.parametrize(
    ("value", "nodes", "min_nodes"), [("2", 2, 0), ("1:2", 2, 1), ("2:2", 2, 2), ("' 1 : 3 '", 3, 1)]
)
def test_nodes_min_max_is_the_elastic_range(value: str, nodes: int, min_nodes: int) -> None:
    cfg = checked_run([f"nodes={value}", "master_addr=10.1.2.3"])
    assert (cfg.world.nodes, cfg.launcher.min_nodes) == (nodes, min_nodes)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (("nodes=3:2",), "nodes"),
        (("nodes=0:2",), "nodes"),
        (("nodes=two",), "nodes"),
        (("nodes=1:2:3",), "nodes"),
        (("nodes=true",), "nodes"),
        (("nodes=1:2", "launcher.min_nodes=2"), "launcher.min_nodes"),
    ],
)
def test_bad_node_ranges_name_the_key(overrides: tuple[str, ...], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        checked_run(["master_addr=10.1.2.3", *overrides])
    assert info.value.key == key and "MIN" in str(info.value)


def test_config_hash_ignores_node_rank_and_diff_names_keys() -> None:
    a = checked_run([*MULTI, "node_rank=0"])
    b = checked_run([*MULTI, "node_rank=1"])
    assert multinode.config_hash(a) == multinode.config_hash(b)
    assert multinode.run_dir_name(a) == multinode.run_dir_name(b)
    c = checked_run([*MULTI, "node_rank=1", "optim.lr=0.5", "trainer.max_epochs=3"])
    assert multinode.config_hash(a) != multinode.config_hash(c)
    diff = multinode.config_diff(multinode.flatten(a), multinode.flatten(c), other=1)
    assert [line.split(":")[0] for line in diff] == ["optim.lr", "trainer.max_epochs"]
    assert "0.5 on node 1" in diff[0]


def test_sbatch_script_is_readable_and_complete(tmp_path: Path) -> None:
    cfg = checked_run(
        [
            *MULTI,
            "launcher=slurm",
            "launcher.partition=gpu",
            "launcher.time=04:00:00",
            "launcher.gpus_per_node=8",
            "launcher.account=lab",
            "launcher.extra=['#SBATCH --exclusive']",
        ]
    )
    script = slurm.sbatch_script(cfg, tmp_path, ["disttrain", "train", "launcher=slurm"])
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --partition=gpu",
        "#SBATCH --time=04:00:00",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --account=lab",
        "#SBATCH --exclusive",
        "#SBATCH --signal=USR1@120",
        "#SBATCH --requeue",
        "scontrol show hostnames",
        f"-m disttrain.launch.slurm_node {tmp_path}",
    ):
        assert line in script, line
    assert "qos" not in script  # unset options stay out


def test_allocation_mismatch_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = checked_run(list(MULTI))
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    monkeypatch.setenv("SLURM_NNODES", "2")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    with pytest.raises(ConfigError, match="SLURM_NTASKS=4 but nodes=2"):
        slurm.check_allocation(cfg)
    monkeypatch.setenv("SLURM_NNODES", "3")
    with pytest.raises(ConfigError, match="SLURM_NNODES of job 7"):
        slurm.check_allocation(cfg)
    monkeypatch.setenv("SLURM_NNODES", "2")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    slurm.check_allocation(cfg)
    monkeypatch.setenv("SLURM_NODEID", "1")
    monkeypatch.setenv("MASTER_ADDR", "node-a")
    assert slurm.allocation_overrides(["nodes=2"]) == ["nodes=2", "node_rank=1", "master_addr=node-a"]


def test_elastic_range_reaches_sbatch_and_the_allocation_check(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    cfg = checked_run(["nodes=2:4", "launcher=slurm"])  # no master_addr: the job script finds node 0
    assert "#SBATCH --nodes=2-4\n" in slurm.sbatch_script(cfg, tmp_path, ["disttrain", "train"])
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    for nnodes in ("2", "3", "4"):
        monkeypatch.setenv("SLURM_NNODES", nnodes)
        monkeypatch.setenv("SLURM_NTASKS", nnodes)
        slurm.check_allocation(cfg)
    monkeypatch.setenv("SLURM_NNODES", "1")
    monkeypatch.setenv("SLURM_NTASKS", "1")
    with pytest.raises(ConfigError, match="nodes=2:4 is not valid"):
        slurm.check_allocation(cfg)


def test_dry_run_prints_the_script_and_submits_nothing(tmp_path: Path) -> None:
    proc = disttrain_in_process(
        "train",
        "launcher=slurm",
        "launcher.dry_run=true",
        "nodes=2",
        "master_addr=h",
        "hydra.run.dir=r",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("#!/bin/bash") and "dry run: not submitted" in proc.stdout
    assert (tmp_path / "r" / "slurm" / "job.sbatch").is_file() and not (
        tmp_path / "r" / "slurm" / "job_id"
    ).exists()


def test_several_nodes_on_loopback_are_a_rehearsal_with_a_warning() -> None:
    """master_addr=127.0.0.1 with nodes=2 is allowed (torchrun allows it): a one-host rehearsal."""
    from disttrain.preflight.launch_checks import rehearsal_warning

    cfg = checked_run(["nodes=2"])  # the default master_addr is 127.0.0.1: no error any more
    warning = rehearsal_warning(cfg)
    assert warning is not None and "rehearsal" in warning and "master_addr=127.0.0.1" in warning
    assert rehearsal_warning(checked_run(["nodes=2", "master_addr=127.0.0.2"])) is not None
    assert rehearsal_warning(checked_run(["nodes=2", "master_addr=10.1.2.3"])) is None
    assert rehearsal_warning(checked_run([])) is None  # one node: nothing to rehearse
    assert rehearsal_warning(checked_run(["nodes=2", "launcher=slurm"])) is None


def _roll_call_cfg(node_rank: int, port: int, *extra: str) -> Run:
    return checked_run(
        ["nodes=2", f"node_rank={node_rank}", "master_addr=127.0.0.1", f"master_port={port}", *extra]
    )


def test_node_that_loses_node_0s_store_says_so_in_a_paragraph(tmp_path: Path) -> None:
    """Node 0 stopped (for its own reason) while another node polled its store: a RendezvousFailure
    paragraph naming the master, not a DistNetworkError traceback."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    host = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = TCPStore("127.0.0.1", host.port, is_master=False, timeout=timedelta(seconds=5))
    cfg = _roll_call_cfg(1, host.port)
    del host  # node 0's process is gone: its store with it
    with pytest.raises(multinode.RendezvousFailure) as err:
        multinode._wait_for_nodes(client, "p", {}, cfg, tmp_path, need=2)
    message = str(err.value)
    assert f"node 1 lost the roll call's store at master 127.0.0.1:{cfg.world.master_port}" in message
    assert "node 0 stopped before the nodes assembled" in message


def test_config_mismatch_node_0_waits_until_the_other_node_read_its_config(tmp_path: Path) -> None:
    """Both nodes name the differing key: node 0, which hosts the store, stops only once the other
    node has read node 0's config (before this, node 1 could find the store gone and print a
    traceback instead of the mismatch)."""
    import threading
    from datetime import timedelta

    from torch.distributed import TCPStore

    host = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = TCPStore("127.0.0.1", host.port, is_master=False, timeout=timedelta(seconds=5))
    cfg0, cfg1 = _roll_call_cfg(0, host.port), _roll_call_cfg(1, host.port, "optim.lr=0.5")
    mine0, mine1 = (multinode._plain(multinode.flatten(c)) for c in (cfg0, cfg1))
    host.set("p/node1", json.dumps(mine1))  # node 1 arrived first; it reads node 0's config later
    errors: dict[int, str] = {}
    read_when_node_0_stopped: list[bool] = []

    def node0() -> None:
        host.set("p/node0", json.dumps(mine0))
        try:
            multinode._wait_for_nodes(host, "p", mine0, cfg0, tmp_path, need=2)
        except multinode.RendezvousFailure as exc:
            errors[0] = str(exc)
            read_when_node_0_stopped.append(host.check(["p/read1"]))

    thread = threading.Thread(target=node0)
    thread.start()
    time.sleep(0.5)  # node 0 has found the mismatch and waits for node 1's read
    assert thread.is_alive() and 0 not in errors
    with pytest.raises(multinode.RendezvousFailure) as err:
        multinode._wait_for_nodes(client, "p", mine1, cfg1, tmp_path, need=2)
    thread.join(timeout=10)
    assert read_when_node_0_stopped == [True]
    for message in (errors[0], str(err.value)):
        assert "config mismatch" in message and "optim.lr" in message, message


def test_a_waiting_node_says_what_for_and_the_command_that_starts_the_other(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 26 #6: node 1, connecting to a master nobody hosts yet, says within FIRST_S which node
    it waits for, where, the timeout, that this is a rehearsal, and the exact command for node 0:
    this node's command line with its node_rank. (Node 0's side: test_multinode's CLI test.)"""
    import socket

    from disttrain.launch import waiting

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(waiting, "FIRST_S", 0.2)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    node_rank, missing = 1, 0
    cfg = _roll_call_cfg(node_rank, port, "launcher.rdzv_timeout=1.5")
    (tmp_path / "command.txt").write_text(f"disttrain train nodes=2 'name=my run' node_rank={node_rank}\n")
    with pytest.raises(multinode.RendezvousFailure):
        multinode.roll_call(cfg, tmp_path)
    err = capsys.readouterr().err
    line, command = err.splitlines()[:2]
    assert line.startswith(
        f"disttrain: node {node_rank} of 2 waits for node rank(s) {missing} at master 127.0.0.1:{port} "
    ), err
    assert "of launcher.rdzv_timeout=1.5 s); a rehearsal on this host" in line, line
    assert command.strip() == f"disttrain train nodes=2 'name=my run' node_rank={missing}"


def test_off_loopback_the_waiting_line_adds_this_nodes_address(tmp_path: Path) -> None:
    from disttrain.launch import waiting

    cfg = checked_run(["nodes=2", "master_addr=10.1.2.3", "master_port=29999"])
    (tmp_path / "command.txt").write_text("disttrain train nodes=2\n")
    text = waiting.waiting_line(cfg, tmp_path, [1], 31.0, first=True)
    assert "waits for node rank(s) 1 at master 10.1.2.3:29999 (31 s of" in text
    assert "start each on its own machine" in text and "rehearsal" not in text
    assert "disttrain train nodes=2 node_rank=1 master_addr=" in text
    assert (
        waiting.waiting_line(cfg, tmp_path, [1], 61.0, first=False).count("\n") == 1
    )  # the repeats: one line
