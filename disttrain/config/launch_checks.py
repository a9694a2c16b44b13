"""Checks of the multi-node and launcher settings (rendezvous, elastic range, SLURM), before launch."""

from __future__ import annotations

import re
import shutil
from typing import Any

from disttrain.config import k8s_checks
from disttrain.config.errors import ConfigError

# sbatch --time: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS
SLURM_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$")


def elastic_nodes(cfg: dict[str, Any]) -> None:
    """`nodes=MIN:MAX` (torchrun's --nnodes syntax) becomes nodes=MAX, launcher.min_nodes=MIN.

    Every later step (checks, launch, the frozen config and its hash) then sees one spelling.
    """
    value = cfg.get("nodes")
    if isinstance(value, int) and not isinstance(value, bool):
        return
    match = None if isinstance(value, bool) else re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", str(value))
    low, high = (int(match[1]), int(match[2] or match[1])) if match else (0, 0)
    if not match or not 1 <= low <= high:
        raise ConfigError(
            "nodes",
            value,
            "an integer >= 1, or MIN:MAX with 1 <= MIN <= MAX (elastic membership)",
            "nodes=2 needs both nodes; nodes=1:2 starts with whichever of 2 nodes arrive (at least 1).",
        )
    given = cfg.get("launcher", {}).get("min_nodes") or 0
    if match[2] is not None and given not in (0, low):
        raise ConfigError(
            "launcher.min_nodes",
            given,
            f"0 or {low} (nodes={value} already sets the minimum)",
            "write the range once: nodes=MIN:MAX, or nodes=MAX launcher.min_nodes=MIN.",
        )
    cfg["nodes"] = high
    if match[2] is not None:
        cfg.setdefault("launcher", {})["min_nodes"] = low


def node_bounds(cfg: dict[str, Any]) -> tuple[int, int]:
    """(fewest, most) nodes the run trains with: launcher.min_nodes (0: all of them) and nodes."""
    nodes = int(cfg["nodes"])
    return int(cfg["launcher"].get("min_nodes") or nodes), nodes


def check_static(cfg: dict[str, Any]) -> None:
    launcher, nodes = cfg["launcher"], int(cfg["nodes"])
    timeout = launcher.get("rdzv_timeout")
    if timeout is None or timeout < 1:
        raise ConfigError(
            "launcher.rdzv_timeout", timeout, "a number of seconds >= 1", "the default 900 suits slow queues."
        )
    last_call = launcher.get("rdzv_last_call", 30)
    if last_call is None or last_call < 1:
        raise ConfigError(
            "launcher.rdzv_last_call",
            last_call,
            "a number of seconds >= 1",
            "after min_nodes have joined, torchrun waits this long for the rest (default 30).",
        )
    interval = launcher.get("monitor_interval")
    if interval is None or not interval > 0:
        raise ConfigError(
            "launcher.monitor_interval",
            interval,
            "a number of seconds > 0",
            "how often torchrun's agent checks the ranks; the default 0.1 suits most runs.",
        )
    grace = launcher.get("stop_grace_s", 120.0)
    if grace is None or grace < 1:
        raise ConfigError(
            "launcher.stop_grace_s",
            grace,
            "a number of seconds >= 1",
            "time for one step plus one checkpoint save after SIGTERM; the default is 120.",
        )
    low = launcher.get("min_nodes") or 0
    if not 0 <= low <= nodes:
        raise ConfigError(
            "launcher.min_nodes",
            low,
            f"0 (all nodes) or 1..{nodes} (nodes={nodes})",
            f"elastic membership: min_nodes=1 nodes={max(nodes, 2)} trains with whichever nodes arrive.",
        )
    port = cfg.get("master_port") or 0
    if not 0 <= port <= 65535:
        raise ConfigError(
            "master_port", port, "0..65535 (0: 29500 with several nodes)", "e.g. master_port=29500."
        )
    if launcher["name"] == "slurm":
        _check_slurm(launcher)
    if launcher["name"] == "k8s":
        k8s_checks.check_static(cfg)


def _check_slurm(launcher: dict[str, Any]) -> None:
    time_limit = launcher.get("time")
    if time_limit is not None and not SLURM_TIME.match(str(time_limit)):
        raise ConfigError(
            "launcher.time",
            time_limit,
            "MM, HH:MM:SS or D-HH:MM:SS (sbatch --time)",
            "e.g. launcher.time=04:00:00.",
        )
    for key in ("gpus_per_node", "cpus_per_task", "signal_before_s"):
        value = launcher.get(key)
        if value is None or value < 0:
            raise ConfigError(f"launcher.{key}", value, "an integer >= 0", "0 leaves it to the cluster.")
    for key in ("partition", "account", "qos"):
        value = launcher.get(key)
        if value is not None and not re.fullmatch(r"[\w.,-]+", str(value)):
            raise ConfigError(
                f"launcher.{key}",
                value,
                "a SLURM name: letters, digits, _ . , -",
                "`sinfo` lists partitions.",
            )
    for line in launcher.get("extra") or []:
        if "\n" in str(line) or not str(line).startswith("#SBATCH "):
            raise ConfigError(
                "launcher.extra",
                line,
                "single lines starting with '#SBATCH '",
                "e.g. launcher.extra='[\"#SBATCH --constraint=a100\"]'.",
            )


LOOPBACK = ("localhost", "::1")


def rehearsal_warning(cfg: dict[str, Any]) -> str | None:
    """Several nodes whose master is this host's loopback: allowed (as torchrun allows it), but said.

    Users rehearse a multi-node config on one machine before a queue wait; on real machines a
    loopback master_addr means the other nodes never arrive, so the launch says which case it is.
    """
    addr = str(cfg.get("master_addr"))
    if int(cfg["nodes"]) == 1 or cfg["launcher"]["name"] == "slurm":
        return None
    if addr not in LOOPBACK and not addr.startswith("127."):
        return None
    return (
        f"master_addr={addr} is this host's loopback: a rehearsal of nodes={cfg['nodes']} on one "
        "machine (start every node_rank here). Nodes on other machines cannot reach it: set "
        "master_addr=ADDRESS_OF_NODE_0 on every node for a real multi-node run."
    )


def check_runtime(cfg: dict[str, Any]) -> None:
    _check_port_free(cfg)
    launcher = cfg["launcher"]
    if launcher["name"] == "slurm" and not launcher.get("dry_run") and shutil.which("sbatch") is None:
        raise ConfigError(
            "launcher",
            "slurm",
            "a machine with `sbatch` on PATH (a cluster login node)",
            "submit from the cluster, or launcher.dry_run=true to print the script here.",
        )
    if launcher["name"] == "k8s":
        k8s_checks.check_runtime(cfg)


def _check_port_free(cfg: dict[str, Any]) -> None:
    """The rendezvous port this launcher will host (master_port on a single node, or node 0's):
    a bind probe now, instead of a RendezvousConnectionError with a multi-node hint after the run
    dir was written. Ranks someone else launched (torchrun -m disttrain, srun) host nothing here."""
    import errno
    import os
    import socket

    from disttrain.launch.multinode import DEFAULT_PORT

    if cfg["launcher"]["name"] in ("slurm", "k8s") or ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
        return
    nodes, port = int(cfg["nodes"]), int(cfg.get("master_port") or 0)
    if (nodes == 1 and not port) or (nodes > 1 and cfg["node_rank"] != 0):
        return
    port = port or DEFAULT_PORT
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers are fine
        try:
            s.bind(("", port))  # the store binds every interface (see README: the trust boundary)
        except OSError as exc:
            taken = exc.errno == errno.EADDRINUSE
            raise ConfigError(
                "master_port",
                cfg.get("master_port") or 0,
                f"a free TCP port on this machine (port {port} is "
                f"{'in use' if taken else 'not bindable: ' + (exc.strerror or str(exc))})",
                f"another run or program listens there (`ss -ltnp 'sport = :{port}'` shows which); "
                + (
                    "use master_port=0 to pick a free one."
                    if nodes == 1
                    else "pick another port on every node."
                ),
            ) from None
