"""The multi-node tests' harness: two network namespaces joined by a veth, a node per namespace.

Each node is `ip netns exec NS disttrain train nodes=2 node_rank=K master_addr=192.168.77.1 ...`
with its own address (192.168.77.1 and .2 exist only inside the namespaces a test creates), so
the rendezvous, the roll call and gloo's traffic all cross the veth pair, not loopback. Used by
test_multinode.py (one shared file system) and test_multinode_private.py (none): two modules, so
that xdist runs them on two workers at once (each is minutes of node runs).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import (
    BASELINE,
    CLI,
    FAST,
    _kill_group,
    _tail,
    clean_env,
    start_in_session,
)

MASTER = "192.168.77.1"
TIMEOUT = 150.0


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)


@contextlib.contextmanager
def namespaces() -> Iterator[tuple[tuple[str, str], tuple[str, str]]]:
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


def run_nodes(
    cwd: Path, nodes: list[tuple[str, str, list[str]]], timeout: float = TIMEOUT
) -> list[subprocess.CompletedProcess[str]]:
    """Start `disttrain train` in each (namespace, veth, overrides) at once; wait for all."""
    commands = [
        (veth, ["ip", "netns", "exec", ns, CLI, "train", *FAST, *overrides]) for ns, veth, overrides in nodes
    ]
    return run_commands(cwd, commands, timeout)


def run_commands(
    cwd: Path, commands: list[tuple[str, list[str]]], timeout: float = TIMEOUT
) -> list[subprocess.CompletedProcess[str]]:
    """Start each (veth, command) in `cwd` at once; wait for all; kill every process group afterwards."""
    # gloo: the veth, not the host's interface
    return run_all([(cmd, cwd, clean_env(GLOO_SOCKET_IFNAME=veth)) for veth, cmd in commands], timeout)


def run_all(
    processes: list[tuple[list[str], Path, dict[str, str]]], timeout: float = TIMEOUT, what: str = "node"
) -> list[subprocess.CompletedProcess[str]]:
    """Start each (command, cwd, env) at once, each in its own session; wait for all; kill every
    process group afterwards (a no-op for one that exited; the ranks of a hung one too)."""
    procs = []
    try:
        for cmd, cwd, env in processes:
            procs.append(start_in_session(cmd, cwd, env))
        results = []
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
        return results
    except subprocess.TimeoutExpired:
        pytest.fail(f"a {what} did not finish in {timeout:.0f} s (killed every {what}'s process group)")
    finally:
        for proc in procs:
            with contextlib.suppress(OSError):
                _kill_group(proc.pid)
            proc.wait(timeout=30)


def node_args(port: int, *extra: str, base: tuple[str, ...] = BASELINE) -> list[str]:
    """`base` (the session baseline's training, 2 ranks) as 2 nodes x 1 rank."""
    return [*base, "nodes=2", "nproc_per_node=1", f"master_addr={MASTER}", f"master_port={port}", *extra]


Baseline = tuple[subprocess.CompletedProcess[str], Path]


def assert_like_one_node(two: list[float], one: list[float]) -> None:
    """6 losses of 2 nodes equal those of one node with 2 ranks and the same config within 1e-6."""
    assert len(two) == len(one) == 6, (two, one)
    diff = max(abs(x - y) for x, y in zip(two, one, strict=True))
    assert diff <= 1e-6, f"2-node losses {two} vs 1-node {one} (max diff {diff:.2e})"


def report(results: list[subprocess.CompletedProcess[str]]) -> str:
    return "\n".join(
        f"--- node {k} rc={r.returncode}\n{_tail(r.stdout + r.stderr, 15)}" for k, r in enumerate(results)
    )
