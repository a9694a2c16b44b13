"""Two nodes across a real network boundary on one machine: two network namespaces joined by a veth.

Each node is `ip netns exec NS disttrain train nodes=2 node_rank=K master_addr=192.168.77.1 ...`
with its own address (192.168.77.1 and .2 exist only inside the namespaces this test creates), so
the rendezvous, the roll call and gloo's traffic all cross the veth pair, not loopback.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from .conftest import (
    CLI,
    FAST,
    QUICK,
    _kill_group,
    _tail,
    clean_env,
    final_weights,
    read_yaml,
    run_cli,
    train_losses,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MASTER = "192.168.77.1"
TIMEOUT = 150.0


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)


@pytest.fixture
def netns_pair() -> Iterator[tuple[tuple[str, str], tuple[str, str]]]:
    """((namespace, veth) of node 0, (namespace, veth) of node 1); removed afterwards."""
    if shutil.which("ip") is None:
        pytest.skip("`ip` (iproute2) is not installed: cannot create network namespaces")
    if os.geteuid() != 0:
        pytest.skip("creating network namespaces needs root")
    tag = uuid.uuid4().hex[:6]
    ns, veth = (f"dt{tag}a", f"dt{tag}b"), (f"dtv{tag}a", f"dtv{tag}b")
    probe = _ip("netns", "add", ns[0])
    if probe.returncode != 0:
        pytest.skip(f"cannot create a network namespace here: `ip netns add` said {probe.stderr.strip()!r}")
    try:
        _ip("netns", "add", ns[1])
        steps = [
            ("link", "add", veth[0], "type", "veth", "peer", "name", veth[1]),
            ("link", "set", veth[0], "netns", ns[0]),
            ("link", "set", veth[1], "netns", ns[1]),
            ("-n", ns[0], "addr", "add", f"{MASTER}/24", "dev", veth[0]),
            ("-n", ns[1], "addr", "add", "192.168.77.2/24", "dev", veth[1]),
            *[("-n", n, "link", "set", dev, "up") for n in ns for dev in ("lo",)],
            ("-n", ns[0], "link", "set", veth[0], "up"),
            ("-n", ns[1], "link", "set", veth[1], "up"),
        ]
        for step in steps:
            res = _ip(*step)
            if res.returncode != 0:
                pytest.skip(f"cannot wire the namespaces: `ip {' '.join(step)}` said {res.stderr.strip()!r}")
        yield (ns[0], veth[0]), (ns[1], veth[1])
    finally:
        for name in ns:  # deleting a namespace deletes its end of the veth, and so the pair
            _ip("netns", "del", name)


def _run_nodes(
    cwd: Path, nodes: list[tuple[str, str, list[str]]], timeout: float = TIMEOUT
) -> list[subprocess.CompletedProcess[str]]:
    """Start `disttrain train` in each (namespace, veth, overrides) at once; wait for all."""
    procs = []
    try:
        for ns, veth, overrides in nodes:
            cmd = ["ip", "netns", "exec", ns, CLI, "train", *FAST, *overrides]
            procs.append(
                subprocess.Popen(
                    cmd,
                    cwd=cwd,
                    env=clean_env(GLOO_SOCKET_IFNAME=veth),  # gloo: the veth, not the host's interface
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    start_new_session=True,
                )
            )
        results = []
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
        return results
    except subprocess.TimeoutExpired:
        pytest.fail(f"a node did not finish in {timeout:.0f} s (killed every node's process group)")
    finally:
        for proc in procs:
            with contextlib.suppress(OSError):
                _kill_group(proc.pid)  # no-op for a node that exited; ranks of a hung one too
            proc.wait(timeout=30)


def _node_args(port: int, *extra: str) -> list[str]:
    return [*QUICK, "nodes=2", "nproc_per_node=1", f"master_addr={MASTER}", f"master_port={port}", *extra]


def _report(results: list[subprocess.CompletedProcess[str]]) -> str:
    return "\n".join(
        f"--- node {k} rc={r.returncode}\n{_tail(r.stdout + r.stderr, 15)}" for k, r in enumerate(results)
    )


def test_two_nodes_equal_one_node_with_the_same_world_size(
    tmp_path: Path, netns_pair: tuple[tuple[str, str], tuple[str, str]]
) -> None:
    (ns0, veth0), (ns1, veth1) = netns_pair
    args = _node_args(29531, "hydra.run.dir=two_nodes")
    results = _run_nodes(
        tmp_path, [(ns0, veth0, [*args, "node_rank=0"]), (ns1, veth1, [*args, "node_rank=1"])]
    )
    assert all(r.returncode == 0 for r in results), _report(results)
    two = tmp_path / "two_nodes"
    assert sorted(p.name for p in (two / "logs").glob("rank*.log")) == ["rank0.log", "rank1.log"]
    records = [json.loads((two / f"rendezvous_node{k}.json").read_text()) for k in (0, 1)]
    assert records[0]["config_hash"] == records[1]["config_hash"] and records[0]["nodes"] == [0, 1]
    _, one = run_cli(tmp_path, *QUICK, "nproc_per_node=2")
    assert one is not None
    a, b = train_losses(two), train_losses(one)
    assert len(a) == len(b) == 6
    diff = max(abs(x - y) for x, y in zip(a, b, strict=True))
    assert diff <= 1e-6, f"2-node losses {a} vs 1-node {b} (max diff {diff:.2e})"
    wa, wb = final_weights(two), final_weights(one)
    assert all(torch.allclose(wa[k], wb[k], atol=1e-6) for k in wa)


def test_nodes_derive_the_same_run_dir_without_hydra_run_dir(
    tmp_path: Path, netns_pair: tuple[tuple[str, str], tuple[str, str]]
) -> None:
    (ns0, veth0), (ns1, veth1) = netns_pair
    args = _node_args(29532, "trainer.max_steps=2")
    results = _run_nodes(
        tmp_path, [(ns0, veth0, [*args, "node_rank=0"]), (ns1, veth1, [*args, "node_rank=1"])]
    )
    assert all(r.returncode == 0 for r in results), _report(results)
    dirs = sorted((tmp_path / "runs" / "default").iterdir())
    assert len(dirs) == 1 and dirs[0].name.startswith("nodes2_"), dirs
    assert all(f"run dir: {dirs[0]}" in r.stdout for r in results), _report(results)


def test_a_node_with_another_config_fails_naming_the_keys(
    tmp_path: Path, netns_pair: tuple[tuple[str, str], tuple[str, str]]
) -> None:
    (ns0, veth0), (ns1, veth1) = netns_pair
    args = _node_args(29533, "launcher.rdzv_timeout=60")
    results = _run_nodes(
        tmp_path,
        [(ns0, veth0, [*args, "node_rank=0"]), (ns1, veth1, [*args, "node_rank=1", "optim.lr=0.5"])],
    )
    for k, r in enumerate(results):
        assert r.returncode == 1, _report(results)
        assert "config mismatch" in r.stderr and "optim.lr" in r.stderr, _report(results)
        assert f"on node {1 - k}" in r.stderr, _report(results)
        assert "Traceback" not in r.stderr


def test_a_node_that_never_arrives_is_named_after_the_timeout(
    tmp_path: Path, netns_pair: tuple[tuple[str, str], tuple[str, str]]
) -> None:
    (ns0, veth0), _ = netns_pair
    args = _node_args(29534, "launcher.rdzv_timeout=4", "node_rank=0")
    (result,) = _run_nodes(tmp_path, [(ns0, veth0, args)], timeout=90)
    assert result.returncode == 1, _report([result])
    assert "node rank(s) 1 never arrived" in result.stderr, result.stderr
    assert f"master {MASTER}:29534" in result.stderr and "after 4 s" in result.stderr
    assert "Traceback" not in result.stderr


def test_elastic_min_nodes_trains_with_the_nodes_that_came(
    tmp_path: Path, netns_pair: tuple[tuple[str, str], tuple[str, str]]
) -> None:
    """`nodes=1:2` (torchrun's --nnodes MIN:MAX): node 0 alone trains once the rendezvous' last
    call (launcher.rdzv_last_call, here 3 s instead of torchrun's 30) has passed."""
    (ns0, veth0), _ = netns_pair
    extra = ("launcher.rdzv_timeout=60", "launcher.rdzv_last_call=3", "node_rank=0", "hydra.run.dir=el")
    args = [a for a in _node_args(29535, *extra) if a != "nodes=2"]
    (result,) = _run_nodes(tmp_path, [(ns0, veth0, [*args, "nodes=1:2"])])
    assert result.returncode == 0, _report([result])
    assert "rank 0 of 1" in result.stderr, result.stderr  # log lines go to stderr
    assert train_losses(tmp_path / "el")
    frozen = read_yaml(tmp_path / "el" / "config.yaml")
    assert frozen["nodes"] == 2 and frozen["launcher"]["min_nodes"] == 1
