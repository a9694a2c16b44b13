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
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from .conftest import (
    BASELINE,
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


@contextlib.contextmanager
def _namespaces() -> Iterator[tuple[tuple[str, str], tuple[str, str]]]:
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


@pytest.fixture
def netns_pair() -> Iterator[tuple[tuple[str, str], tuple[str, str]]]:
    """((namespace, veth) of node 0, (namespace, veth) of node 1); removed afterwards."""
    with _namespaces() as pair:
        yield pair


def _run_nodes(
    cwd: Path, nodes: list[tuple[str, str, list[str]]], timeout: float = TIMEOUT
) -> list[subprocess.CompletedProcess[str]]:
    """Start `disttrain train` in each (namespace, veth, overrides) at once; wait for all."""
    commands = [
        (veth, ["ip", "netns", "exec", ns, CLI, "train", *FAST, *overrides]) for ns, veth, overrides in nodes
    ]
    return _run_commands(cwd, commands, timeout)


def _run_commands(
    cwd: Path, commands: list[tuple[str, list[str]]], timeout: float = TIMEOUT
) -> list[subprocess.CompletedProcess[str]]:
    """Start each (veth, command) at once; wait for all; kill every process group afterwards."""
    procs = []
    try:
        for veth, cmd in commands:
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


def _node_args(port: int, *extra: str, base: tuple[str, ...] = BASELINE) -> list[str]:
    """`base` (the session baseline's training, 2 ranks) as 2 nodes x 1 rank."""
    return [*base, "nodes=2", "nproc_per_node=1", f"master_addr={MASTER}", f"master_port={port}", *extra]


Baseline = tuple[subprocess.CompletedProcess[str], Path]


def _assert_like_one_node(two: list[float], one: list[float]) -> None:
    """6 losses of 2 nodes equal those of one node with 2 ranks and the same config within 1e-6."""
    assert len(two) == len(one) == 6, (two, one)
    diff = max(abs(x - y) for x, y in zip(two, one, strict=True))
    assert diff <= 1e-6, f"2-node losses {two} vs 1-node {one} (max diff {diff:.2e})"


def _report(results: list[subprocess.CompletedProcess[str]]) -> str:
    return "\n".join(
        f"--- node {k} rc={r.returncode}\n{_tail(r.stdout + r.stderr, 15)}" for k, r in enumerate(results)
    )


@pytest.fixture(scope="module")
def two_nodes(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, list[subprocess.CompletedProcess[str]]]:
    """The baseline's run on two nodes (1 rank each), no hydra.run.dir: (cwd, the nodes' results)."""
    cwd = tmp_path_factory.mktemp("two_nodes")
    with _namespaces() as ((ns0, veth0), (ns1, veth1)):
        args = _node_args(29531)
        results = _run_nodes(
            cwd, [(ns0, veth0, [*args, "node_rank=0"]), (ns1, veth1, [*args, "node_rank=1"])]
        )
    assert all(r.returncode == 0 for r in results), _report(results)
    return cwd, results


def test_two_nodes_equal_one_node_with_the_same_world_size(
    two_nodes: tuple[Path, list[subprocess.CompletedProcess[str]]], baseline: Baseline
) -> None:
    (two,) = sorted((two_nodes[0] / "runs" / "default").iterdir())
    assert sorted(p.name for p in (two / "logs").glob("rank*.log")) == ["rank0.log", "rank1.log"]
    records = [json.loads((two / f"rendezvous_node{k}.json").read_text()) for k in (0, 1)]
    assert records[0]["config_hash"] == records[1]["config_hash"] and records[0]["nodes"] == [0, 1]
    _assert_like_one_node(train_losses(two), train_losses(baseline[1]))
    wa, wb = final_weights(two), final_weights(baseline[1])
    assert all(torch.allclose(wa[k], wb[k], atol=1e-6) for k in wa)


def test_nodes_derive_the_same_run_dir_without_hydra_run_dir(
    two_nodes: tuple[Path, list[subprocess.CompletedProcess[str]]],
) -> None:
    cwd, results = two_nodes
    dirs = sorted((cwd / "runs" / "default").iterdir())
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


# --------------------------------------------------------------------------- no shared file system
# Each node also gets a private mount namespace: `work/` is bind-mounted from the node's own
# `nodeK/` folder, so the two nodes see different contents at the same path (different machines
# with local disks). `shared/` stays one folder both see: a shared checkpoint.dir.


def _private_node(tmp_path: Path, ns: str, node: int, cmd: list[str]) -> list[str]:
    own, work = tmp_path / f"node{node}", tmp_path / "work"
    own.mkdir(exist_ok=True)
    work.mkdir(exist_ok=True)
    script = 'mount --bind "$1" "$2" && cd "$2" && shift 2 && exec "$@"'
    return [
        *("ip", "netns", "exec", ns, "unshare", "--mount", "--propagation", "private"),
        *("sh", "-c", script, "sh", str(own), str(work), *cmd),
    ]


def _by_hand(
    tmp_path: Path, netns: Any, port: int, *extra: str, base: tuple[str, ...] = BASELINE
) -> list[subprocess.CompletedProcess[str]]:
    args = _node_args(port, "launcher.rdzv_timeout=60", *extra, base=base)
    return _run_commands(
        tmp_path,
        [
            (veth, _private_node(tmp_path, ns, k, [CLI, "train", *FAST, *args, f"node_rank={k}"]))
            for k, (ns, veth) in enumerate(netns)
        ],
    )


def _external_torchrun(
    tmp_path: Path, netns: Any, port: int, *extra: str
) -> list[subprocess.CompletedProcess[str]]:
    """`torchrun --nnodes=2 --node_rank=K -m disttrain train ...` on each node (static rendezvous)."""
    commands = []
    for k, (ns, veth) in enumerate(netns):
        torchrun = [
            *(sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={k}"),
            *("--nproc_per_node=1", f"--master_addr={MASTER}", f"--master_port={port}"),
            *("-m", "disttrain", "train", *FAST, *BASELINE, *extra),
        ]
        commands.append((veth, _private_node(tmp_path, ns, k, torchrun)))
    return _run_commands(tmp_path, commands)


def _assert_failed_before_training(results: list[subprocess.CompletedProcess[str]], run_dir: Path) -> None:
    for r in results:
        assert r.returncode != 0, _report(results)
    text = "".join(r.stderr for r in results)
    assert "checkpoint.dir" in text and "every node" in text and "HINT" in text, _report(results)
    assert not (run_dir / "metrics.jsonl").is_file() or not train_losses(run_dir), "it trained first"


def test_private_run_dirs_without_a_shared_checkpoint_dir_fail_before_training(
    tmp_path: Path, netns_pair: tuple[tuple[str, str], tuple[str, str]]
) -> None:
    results = _by_hand(tmp_path, netns_pair, 29536, "hydra.run.dir=priv")
    _assert_failed_before_training(results, tmp_path / "node0" / "priv")
    for r in results:  # the launcher's one paragraph, not each rank's traceback
        assert "Traceback" not in r.stderr and "training failed" in r.stderr, _report(results)
    # Each node kept its own run dir, with its own frozen config, logs and status.
    for k in (0, 1):
        own = tmp_path / f"node{k}" / "priv"
        assert (own / "config.yaml").is_file() and (own / "logs" / f"rank{k}.log").is_file()
        assert read_yaml(own / "status.json")["status"] == "failed"


def test_private_run_dirs_train_and_resume_through_a_shared_checkpoint_dir(
    tmp_path: Path, netns_pair: tuple[tuple[str, str], tuple[str, str]]
) -> None:
    """3 steps, then a new run (its own run dirs) to step 6 resuming from the shared dir: the
    6 losses equal one node's uninterrupted run (constant schedule, so the horizon does not matter;
    no dropout: the first run's end-of-run validation draws from the RNG its final checkpoint keeps,
    which an uninterrupted run does not)."""
    shared = tmp_path / "shared" / "ckpt"
    base = (*QUICK, "sched=constant")
    common = (f"checkpoint.dir={shared}",)
    first = _by_hand(
        tmp_path, netns_pair, 29537, *common, "trainer.max_steps=3", "hydra.run.dir=a", base=base
    )
    assert all(r.returncode == 0 for r in first), _report(first)
    second = _by_hand(tmp_path, netns_pair, 29538, *common, "hydra.run.dir=b", base=base)
    assert all(r.returncode == 0 for r in second), _report(second)
    summary = json.loads((tmp_path / "node0" / "b" / "summary.json").read_text())
    assert summary["resumed_from"].startswith(str(shared)), summary
    assert (shared / "final.pt").is_file() and not (tmp_path / "node0" / "b" / "checkpoints").exists()
    assert (tmp_path / "node1" / "b" / "logs" / "rank1.log").is_file()  # node 1's logs: its own dir
    (tmp_path / "one").mkdir()
    _, one = run_cli(tmp_path / "one", *base, "nproc_per_node=2")
    assert one is not None
    _assert_like_one_node(
        train_losses(tmp_path / "node0" / "a") + train_losses(tmp_path / "node0" / "b"), train_losses(one)
    )


def test_external_torchrun_on_two_nodes_without_a_shared_run_dir(
    tmp_path: Path, netns_pair: tuple[tuple[str, str], tuple[str, str]], baseline: Baseline
) -> None:
    """torchrun --nnodes=2 (as Kubeflow, TorchX and SkyPilot start ranks): node 1 gets the frozen
    config from rank 0, not a path; each node writes its own run record. Without a shared
    checkpoint.dir it fails before the first step; with one it trains like one node."""
    blind = _external_torchrun(tmp_path, netns_pair, 29539, "hydra.run.dir=ext0")
    _assert_failed_before_training(blind, tmp_path / "node0" / "ext0")
    results = _external_torchrun(
        tmp_path, netns_pair, 29540, "hydra.run.dir=ext", f"checkpoint.dir={tmp_path / 'shared'}"
    )
    assert all(r.returncode == 0 for r in results), _report(results)
    for k in (0, 1):
        own = tmp_path / f"node{k}" / "ext"
        frozen = read_yaml(own / "config.yaml")
        assert frozen["nodes"] == 2 and frozen["nproc_per_node"] == 1 and frozen["node_rank"] == k
        launch = read_yaml(own / "launch.json")
        assert launch["launcher"] == "torchrun" and launch["world_size"] == 2
        assert "torch.distributed.run --nnodes=2" in (own / "command.txt").read_text()
        assert read_yaml(own / "status.json")["status"] == "finished"
        assert (own / "logs" / f"rank{k}.log").is_file()
    hashes = {
        read_yaml(tmp_path / f"node{k}" / "ext" / f"rendezvous_node{k}.json")["config_hash"] for k in (0, 1)
    }
    assert len(hashes) == 1
    _assert_like_one_node(train_losses(tmp_path / "node0" / "ext"), train_losses(baseline[1]))


def test_pods_with_kubeflow_environment_train_without_a_shared_run_dir(
    tmp_path: Path, netns_pair: tuple[tuple[str, str], tuple[str, str]], baseline: Baseline
) -> None:
    """A PyTorchJob/TrainJob pod runs `python -m disttrain train` with MASTER_ADDR/PORT, WORLD_SIZE,
    RANK and PET_* set by the operator, and no LOCAL_* variables: each pod is a node launcher (as
    torchrun would be there) whose shape comes from PET_NNODES/PET_NPROC_PER_NODE."""
    commands = []
    for k, (ns, veth) in enumerate(netns_pair):
        pod_env = {
            "MASTER_ADDR": MASTER,
            "MASTER_PORT": "29543",
            "WORLD_SIZE": "2",
            "RANK": str(k),
            "PET_NNODES": "2",
            "PET_NPROC_PER_NODE": "1",
            "PET_NODE_RANK": str(k),
        }
        cmd = [
            "env",
            *(f"{key}={value}" for key, value in pod_env.items()),
            *(sys.executable, "-m", "disttrain", "train", *FAST, *BASELINE, "hydra.run.dir=pod"),
            f"checkpoint.dir={tmp_path / 'shared'}",
        ]
        commands.append((veth, _private_node(tmp_path, ns, k, cmd)))
    results = _run_commands(tmp_path, commands)
    assert all(r.returncode == 0 for r in results), _report(results)
    for k in (0, 1):
        own = tmp_path / f"node{k}" / "pod"
        frozen = read_yaml(own / "config.yaml")  # the pod is a node launcher: the shape from PET_*
        assert (frozen["nodes"], frozen["node_rank"], frozen["nproc_per_node"]) == (2, k, 1)
        assert read_yaml(own / "status.json")["status"] == "finished"
        assert "-m disttrain train" in (own / "command.txt").read_text()
    _assert_like_one_node(train_losses(tmp_path / "node0" / "pod"), train_losses(baseline[1]))


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
    results = _run_commands(tmp_path, commands)
    assert all(r.returncode == 0 for r in results), _report(results)
    assert all("rehearsal" in r.stderr and "master_addr=127.0.0.1" in r.stderr for r in results)
    assert len(train_losses(tmp_path / "rehearsal")) == 6
