"""Several nodes, started by hand or by srun: agree on the config before torchrun's rendezvous.

Node 0's launcher hosts one TCPStore on master_addr:master_port; every node's launcher writes its
resolved config there (a roll call), compares it with every other node's, and waits until
`launcher.min_nodes` (default: all `nodes`) have arrived. Only then does torchrun's c10d rendezvous
run on the same store. So a node with a different config fails naming the keys that differ, and a
node that never arrives is named after `launcher.rdzv_timeout` — before any rank starts.
"""

from __future__ import annotations

import contextlib
import json
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from disttrain.config import fingerprint
from disttrain.launch.address import endpoint
from disttrain.launch.errors import LaunchError
from disttrain.launch.waiting import Announcer
from disttrain.safefile import write_text_atomic

if TYPE_CHECKING:
    from disttrain.config.run import Run

# Keys that may differ between nodes: they say *which* node this is, not what the run is.
PER_NODE_KEYS = ("node_rank",)


class RendezvousFailure(LaunchError):
    """The nodes did not assemble: a message with the numbers and a hint, exit code 1."""

    def __init__(self, message: str, run_dir: Path) -> None:
        RuntimeError.__init__(self, message)
        self.rank, self.error, self.run_dir, self.exit_code = None, message, run_dir, 1


def node_bounds(run: Run) -> tuple[int, int]:
    """(fewest, most) nodes the run trains with: launcher.min_nodes (0: all of them) and nodes."""
    nodes = run.world.nodes
    return run.launcher.min_nodes or nodes, nodes


def flatten(run: Run) -> dict[str, Any]:
    """{"trainer.max_epochs": 2, ...}: the config as dotted keys, without per-node keys."""
    return fingerprint.flatten(run.to_dict(), PER_NODE_KEYS)


def config_hash(run: Run) -> str:
    """sha256 of the resolved config without per-node keys: equal on every node of one run."""
    return fingerprint.digest(_plain(flatten(run)))


def config_diff(mine: dict[str, Any], theirs: dict[str, Any], other: int = 0, limit: int = 12) -> list[str]:
    """'trainer.max_epochs: 2 here, 3 on node 1'-style lines for every key that differs."""
    diffs = fingerprint.differences(mine, theirs)
    shown = [f"{k}: {a!r} here, {b!r} on node {other}" for k, a, b in diffs[:limit]]
    if len(diffs) > limit:
        shown.append(f"... and {len(diffs) - limit} more")
    return shown


def roll_call(run: Run, run_dir: Path) -> Any:
    """Connect to (node 0: host) the store, check every node's config, wait for the others; while
    waiting, say what for and how to start the missing nodes (launch/waiting.py).

    Returns the store; it must stay alive (on node 0 it serves torchrun's rendezvous too).
    """
    host, port = endpoint(run)
    me, nodes = run.world.node_rank, run.world.nodes
    need, _ = node_bounds(run)
    missing = [0] if me else list(range(1, nodes))  # what the waiting lines name; the roll call updates it
    with Announcer(run, run_dir, lambda: list(missing)):
        store = _connect(run, run_dir)
        prefix = f"disttrain/{run.name}/roll_call"
        mine = _plain(flatten(run))
        store.set(f"{prefix}/node{me}", json.dumps(mine))
        present = _wait_for_nodes(store, prefix, mine, run, run_dir, need, missing)
    record = {"config_hash": config_hash(run), "master": f"{host}:{port}", "node_rank": me, "nodes": present}
    write_text_atomic(run_dir / f"rendezvous_node{me}.json", json.dumps(record, indent=1) + "\n")
    return store


def _connect(run: Run, run_dir: Path) -> Any:
    """The roll call's store: node 0 hosts it, the others connect (waiting up to rdzv_timeout)."""
    from torch.distributed import TCPStore

    host, port = endpoint(run)
    timeout = run.launcher.rdzv_timeout
    me, nodes = run.world.node_rank, run.world.nodes
    try:
        return TCPStore(
            host,
            port,
            is_master=me == 0,
            multi_tenant=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout),
        )
    except (RuntimeError, TimeoutError, ValueError) as exc:
        who = (
            "could not host it (is the port free and the address this machine's?)"
            if me == 0
            else (f"waited {timeout:g} s: node rank 0 never arrived (launcher.rdzv_timeout)")
        )
        raise RendezvousFailure(
            f"rendezvous failed: node {me} of {nodes} at master {host}:{port} {who}. "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})\n"
            f"  HINT: start node 0 with the same master_addr/master_port, check {host}:{port} is "
            "reachable from this node, or raise launcher.rdzv_timeout.",
            run_dir,
        ) from None


MISMATCH_LINGER_S = 5.0  # how long node 0 keeps its store up for a node whose config differs


def _wait_for_nodes(
    store: Any,
    prefix: str,
    mine: dict[str, Any],
    run: Run,
    run_dir: Path,
    need: int,
    missing: list[int] | None = None,
) -> list[int]:
    """Poll the roll call until `need` nodes are present; every newcomer's config is compared.

    Node 0 hosts the store: on a mismatch it waits (up to MISMATCH_LINGER_S) until the other node
    has read node 0's config, so that both name the differing keys; a node that loses the store
    anyway (node 0 stopped for another reason) says so in one paragraph."""
    host, port = endpoint(run)
    try:
        return _roll_call(store, prefix, mine, run, run_dir, need, [] if missing is None else missing)
    except RendezvousFailure:
        raise
    except RuntimeError as exc:  # DistNetworkError, DistStoreError: the store's host went away
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise RendezvousFailure(
            f"rendezvous failed: node {run.world.node_rank} lost the roll call's store at master "
            f"{host}:{port} ({type(exc).__name__}: {first})\n  HINT: node 0 stopped before the nodes "
            "assembled; its own error says why (a config mismatch, a bad input): fix it and start "
            "every node again.",
            run_dir,
        ) from None


def _roll_call(
    store: Any,
    prefix: str,
    mine: dict[str, Any],
    run: Run,
    run_dir: Path,
    need: int,
    missing: list[int],
) -> list[int]:
    host, port = endpoint(run)
    me, nodes = run.world.node_rank, run.world.nodes
    timeout = run.launcher.rdzv_timeout
    deadline = time.monotonic() + timeout
    checked: set[int] = {me}
    while True:
        present = [k for k in range(nodes) if k in checked or store.check([f"{prefix}/node{k}"])]
        for k in sorted(set(present) - checked):
            theirs = json.loads(store.get(f"{prefix}/node{k}"))
            if k == 0:
                store.set(f"{prefix}/read{me}", "1")  # node 0 may stop now: its config is read
            diff = config_diff(mine, theirs, k)
            if diff:
                if me == 0:
                    _linger(store, f"{prefix}/read{k}")
                lines = "\n    ".join(diff)
                raise RendezvousFailure(
                    f"config mismatch: node {me} (hash {config_hash(run)[:12]}) and node {k} "
                    f"(hash {fingerprint.digest(theirs)[:12]}) joined {host}:{port} with different configs:\n"
                    f"    {lines}\n  HINT: every node must run the same command and config files; "
                    "only node_rank differs.",
                    run_dir,
                )
            checked.add(k)
        missing[:] = sorted(set(range(nodes)) - set(present))
        if len(present) >= need:
            return present
        if time.monotonic() > deadline:
            missing = sorted(set(range(nodes)) - set(present))
            raise RendezvousFailure(
                f"rendezvous timed out after {timeout:g} s (launcher.rdzv_timeout) at master "
                f"{host}:{port}: node rank(s) {', '.join(map(str, missing))} never arrived "
                f"({len(present)} of {need} needed: node(s) {', '.join(map(str, present))} present).\n"
                f"  HINT: start `disttrain train ... nodes={run.world.nodes} node_rank=K "
                f"master_addr={host}` on the missing node(s), check they reach {host}:{port}, "
                "or raise launcher.rdzv_timeout.",
                run_dir,
            )
        time.sleep(0.2)


def _linger(store: Any, key: str) -> None:
    """Node 0, before it stops on a mismatch: wait (bounded) until the other node has read node 0's
    config (`key`), so that the store it hosts does not vanish under that node's read."""

    with contextlib.suppress(RuntimeError):  # DistStoreError on timeout: stop anyway
        store.wait([key], timedelta(seconds=MISMATCH_LINGER_S))


def _plain(flat: dict[str, Any]) -> dict[str, Any]:
    """As the other nodes will read it back from the store (JSON)."""
    result: dict[str, Any] = json.loads(json.dumps(flat, default=str))
    return result


def run_dir_name(run: Run) -> str:
    """The run dir every node derives alike when the user sets no hydra.run.dir."""
    return f"runs/{run.name}/nodes{run.world.nodes}_{config_hash(run)[:10]}"
