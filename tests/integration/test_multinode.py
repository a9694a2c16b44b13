"""Two nodes across a real network boundary on one machine: two network namespaces joined by a veth.

Each node is `ip netns exec NS disttrain train nodes=2 node_rank=K master_addr=192.168.77.1 ...`
with its own address (192.168.77.1 and .2 exist only inside the namespaces this test creates), so
the rendezvous, the roll call and gloo's traffic all cross the veth pair, not loopback.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import torch

from .conftest import (
    CLI,
    FAST,
    QUICK,
    _kill_group,
    clean_env,
    final_weights,
    read_yaml,
    start_in_session,
    train_losses,
)
from .netns import (
    MASTER,
    Baseline,
    assert_like_one_node,
    namespaces,
    node_args,
    report,
    run_commands,
    run_nodes,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def two_nodes(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, list[subprocess.CompletedProcess[str]]]:
    """The baseline's run on two nodes (1 rank each), no hydra.run.dir: (cwd, the nodes' results)."""
    cwd = tmp_path_factory.mktemp("two_nodes")
    with namespaces() as ((ns0, veth0), (ns1, veth1)):
        args = node_args(29531)
        results = run_nodes(cwd, [(ns0, veth0, [*args, "node_rank=0"]), (ns1, veth1, [*args, "node_rank=1"])])
    assert all(r.returncode == 0 for r in results), report(results)
    return cwd, results


def test_two_nodes_equal_one_node_with_the_same_world_size(
    two_nodes: tuple[Path, list[subprocess.CompletedProcess[str]]], baseline: Baseline
) -> None:
    (two,) = sorted((two_nodes[0] / "runs" / "default").iterdir())
    assert sorted(p.name for p in (two / "logs").glob("rank*.log")) == ["rank0.log", "rank1.log"]
    records = [json.loads((two / f"rendezvous_node{k}.json").read_text()) for k in (0, 1)]
    assert records[0]["config_hash"] == records[1]["config_hash"] and records[0]["nodes"] == [0, 1]
    assert_like_one_node(train_losses(two), train_losses(baseline[1]))
    wa, wb = final_weights(two), final_weights(baseline[1])
    assert all(torch.allclose(wa[k], wb[k], atol=1e-6) for k in wa)


def test_nodes_derive_the_same_run_dir_without_hydra_run_dir(
    two_nodes: tuple[Path, list[subprocess.CompletedProcess[str]]],
) -> None:
    cwd, results = two_nodes
    dirs = sorted((cwd / "runs" / "default").iterdir())
    assert len(dirs) == 1 and dirs[0].name.startswith("nodes2_"), dirs
    assert all(f"run dir: {dirs[0]}" in r.stdout for r in results), report(results)


def test_a_node_with_another_config_fails_naming_the_keys(
    tmp_path: Path, netns_pair: tuple[tuple[str, str], tuple[str, str]]
) -> None:
    (ns0, veth0), (ns1, veth1) = netns_pair
    args = node_args(29533, "launcher.rdzv_timeout=60")
    results = run_nodes(
        tmp_path,
        [(ns0, veth0, [*args, "node_rank=0"]), (ns1, veth1, [*args, "node_rank=1", "optim.lr=0.5"])],
    )
    for k, r in enumerate(results):
        assert r.returncode == 1, report(results)
        assert "config mismatch" in r.stderr and "optim.lr" in r.stderr, report(results)
        assert f"on node {1 - k}" in r.stderr, report(results)
        assert "Traceback" not in r.stderr


def test_a_node_that_never_arrives_is_named_after_the_timeout(
    tmp_path: Path, netns_pair: tuple[tuple[str, str], tuple[str, str]]
) -> None:
    (ns0, veth0), _ = netns_pair
    args = node_args(29534, "launcher.rdzv_timeout=4", "node_rank=0")
    (result,) = run_nodes(tmp_path, [(ns0, veth0, args)], timeout=90)
    assert result.returncode == 1, report([result])
    assert "node rank(s) 1 never arrived" in result.stderr, result.stderr
    assert f"master {MASTER}:29534" in result.stderr and "after 4 s" in result.stderr
    assert "Traceback" not in result.stderr
    # No silent wait (issue 26 #6): within the timeout it said what for and how to start node 1.
    assert f"node 0 of 2 waits for node rank(s) 1 at master {MASTER}:29534" in result.stderr
    assert "start each on its own machine:" in result.stderr and "node_rank=1" in result.stderr


def test_elastic_min_nodes_trains_with_the_nodes_that_came(
    tmp_path: Path, netns_pair: tuple[tuple[str, str], tuple[str, str]]
) -> None:
    """`nodes=1:2` (torchrun's --nnodes MIN:MAX): node 0 alone trains once the rendezvous' last
    call (launcher.rdzv_last_call, here 3 s instead of torchrun's 30) has passed."""
    (ns0, veth0), _ = netns_pair
    extra = ("launcher.rdzv_timeout=60", "launcher.rdzv_last_call=3", "node_rank=0", "hydra.run.dir=el")
    args = [a for a in node_args(29535, *extra) if a != "nodes=2"]
    (result,) = run_nodes(tmp_path, [(ns0, veth0, [*args, "nodes=1:2"])])
    assert result.returncode == 0, report([result])
    assert "rank 0 of 1" in result.stderr, result.stderr  # log lines go to stderr
    assert train_losses(tmp_path / "el")
    frozen = read_yaml(tmp_path / "el" / "config.yaml")
    assert frozen["nodes"] == 2 and frozen["launcher"]["min_nodes"] == 1


def test_two_nodes_typed_on_one_host_say_within_5_s_what_they_wait_for(tmp_path: Path) -> None:
    """Issue 26 #6: the mission's own command on one host prints, within 5 s of waiting, the node
    it waits for, that it is a rehearsal, and the command for node 1; the test kills it then."""
    import re
    import socket
    import threading

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [CLI, "train", *FAST, "strategy=fsdp", "nodes=2", f"master_port={port}", "backend=gloo"]
    proc = start_in_session(cmd, tmp_path, clean_env())
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    deadline = time.monotonic() + 90  # the CLI's own start (seconds on a loaded 2-core machine)
    try:
        while not any("node_rank=1" in ln for ln in lines) and time.monotonic() < deadline:
            if proc.poll() is not None:
                break
            time.sleep(0.1)
    finally:
        _kill_group(proc.pid)
        proc.wait()
        reader.join(timeout=5)
    text = "".join(lines)
    waiting = next((ln for ln in lines if "waits for node rank(s)" in ln), "")
    assert waiting.startswith(
        f"disttrain: node 0 of 2 waits for node rank(s) 1 at master 127.0.0.1:{port} ("
    ), text
    waited = re.search(r"\((\d+) s of launcher.rdzv_timeout=900 s\); a rehearsal on this host", waiting)
    assert waited and int(waited.group(1)) <= 5, waiting
    command = lines[lines.index(waiting) + 1].strip()
    assert command.startswith("disttrain train ") and command.endswith("node_rank=1"), text
    assert f"master_port={port}" in command and "strategy=fsdp" in command


def test_two_nodes_on_loopback_are_a_rehearsal_that_trains(tmp_path: Path) -> None:
    """master_addr=127.0.0.1 with nodes=2: allowed (torchrun allows it) with a rehearsal warning."""
    args = [*QUICK, "nodes=2", "nproc_per_node=1", "master_addr=127.0.0.1", "master_port=29544"]
    commands = [
        (
            "lo",
            [
                CLI,
                "train",
                *FAST,
                *args,
                "launcher.rdzv_timeout=60",
                "hydra.run.dir=rehearsal",
                f"node_rank={k}",
            ],
        )
        for k in (0, 1)
    ]
    results = run_commands(tmp_path, commands)
    assert all(r.returncode == 0 for r in results), report(results)
    assert all("rehearsal" in r.stderr and "master_addr=127.0.0.1" in r.stderr for r in results)
    assert len(train_losses(tmp_path / "rehearsal")) == 6
