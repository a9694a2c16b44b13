"""Two nodes without a shared file system (private run dirs, external torchrun, Kubeflow pods), each
node in its own network namespace (tests/integration/netns.py) and its own mount namespace."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from .conftest import (
    BASELINE,
    CLI,
    FAST,
    QUICK,
    read_yaml,
    run_cli,
    train_losses,
)
from .netns import (
    MASTER,
    Baseline,
    assert_like_one_node,
    node_args,
    report,
    run_commands,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


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
    args = node_args(port, "launcher.rdzv_timeout=60", *extra, base=base)
    return run_commands(
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
    return run_commands(tmp_path, commands)


def _assert_failed_before_training(results: list[subprocess.CompletedProcess[str]], run_dir: Path) -> None:
    for r in results:
        assert r.returncode != 0, report(results)
    text = "".join(r.stderr for r in results)
    assert "checkpoint.dir" in text and "every node" in text and "HINT" in text, report(results)
    assert not (run_dir / "metrics.jsonl").is_file() or not train_losses(run_dir), "it trained first"


def test_private_run_dirs_without_a_shared_checkpoint_dir_fail_before_training(
    tmp_path: Path, netns_pair: tuple[tuple[str, str], tuple[str, str]]
) -> None:
    results = _by_hand(tmp_path, netns_pair, 29536, "hydra.run.dir=priv")
    _assert_failed_before_training(results, tmp_path / "node0" / "priv")
    for r in results:  # the launcher's one paragraph, not each rank's traceback
        assert "Traceback" not in r.stderr and "training failed" in r.stderr, report(results)
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
    assert all(r.returncode == 0 for r in first), report(first)
    # a new run dir continues another run's checkpoints only when resume= names them (D6)
    second = _by_hand(tmp_path, netns_pair, 29538, *common, f"resume={shared}", "hydra.run.dir=b", base=base)
    assert all(r.returncode == 0 for r in second), report(second)
    summary = json.loads((tmp_path / "node0" / "b" / "summary.json").read_text())
    assert summary["resumed_from"].startswith(str(shared)), summary
    assert (shared / "final.pt").is_file() and not (tmp_path / "node0" / "b" / "checkpoints").exists()
    assert (tmp_path / "node1" / "b" / "logs" / "rank1.log").is_file()  # node 1's logs: its own dir
    (tmp_path / "one").mkdir()
    _, one = run_cli(tmp_path / "one", *base, "nproc_per_node=2")
    assert one is not None
    assert_like_one_node(
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
    assert all(r.returncode == 0 for r in results), report(results)
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
    assert_like_one_node(train_losses(tmp_path / "node0" / "ext"), train_losses(baseline[1]))


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
    results = run_commands(tmp_path, commands)
    assert all(r.returncode == 0 for r in results), report(results)
    for k in (0, 1):
        own = tmp_path / f"node{k}" / "pod"
        frozen = read_yaml(own / "config.yaml")  # the pod is a node launcher: the shape from PET_*
        assert (frozen["nodes"], frozen["node_rank"], frozen["nproc_per_node"]) == (2, k, 1)
        assert read_yaml(own / "status.json")["status"] == "finished"
        assert "-m disttrain train" in (own / "command.txt").read_text()
    assert_like_one_node(train_losses(tmp_path / "node0" / "pod"), train_losses(baseline[1]))
