"""Checks of the multi-node settings every launcher shares (rendezvous, elastic range, port), before
launch; each launcher's own checks are its `check_static` / `check_runtime` (disttrain.launch)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from disttrain.config.errors import ConfigError

if TYPE_CHECKING:
    from disttrain.config.run import Run


def check_static(run: Run) -> None:
    """The rendezvous settings every launcher shares, then the chosen launcher's own checks."""
    from disttrain.launch.registry import launcher_for

    launcher, nodes = run.launcher, run.world.nodes
    if launcher.rdzv_timeout < 1:
        raise ConfigError(
            "launcher.rdzv_timeout",
            launcher.rdzv_timeout,
            "a number of seconds >= 1",
            "the default 900 suits slow queues.",
        )
    if launcher.rdzv_last_call < 1:
        raise ConfigError(
            "launcher.rdzv_last_call",
            launcher.rdzv_last_call,
            "a number of seconds >= 1",
            "after min_nodes have joined, torchrun waits this long for the rest (default 30).",
        )
    if not launcher.monitor_interval > 0:
        raise ConfigError(
            "launcher.monitor_interval",
            launcher.monitor_interval,
            "a number of seconds > 0",
            "how often torchrun's agent checks the ranks; the default 0.1 suits most runs.",
        )
    if launcher.stop_grace_s < 1:
        raise ConfigError(
            "launcher.stop_grace_s",
            launcher.stop_grace_s,
            "a number of seconds >= 1",
            "time for one step plus one checkpoint save after SIGTERM; the default is 120.",
        )
    low = launcher.min_nodes
    if not 0 <= low <= nodes:
        raise ConfigError(
            "launcher.min_nodes",
            low,
            f"0 (all nodes) or 1..{nodes} (nodes={nodes})",
            f"elastic membership: min_nodes=1 nodes={max(nodes, 2)} trains with whichever nodes arrive.",
        )
    port = run.world.master_port
    if not 0 <= port <= 65535:
        raise ConfigError(
            "master_port", port, "0..65535 (0: 29500 with several nodes)", "e.g. master_port=29500."
        )
    launcher_for(run).check_static(run)


LOOPBACK = ("localhost", "::1")


def rehearsal_warning(run: Run) -> str | None:
    """Several nodes whose master is this host's loopback: allowed (as torchrun allows it), but said.

    Users rehearse a multi-node config on one machine before a queue wait; on real machines a
    loopback master_addr means the other nodes never arrive, so the launch says which case it is.
    """
    addr = run.world.master_addr
    from disttrain.launch.registry import launcher_for

    if run.world.nodes == 1 or launcher_for(run).scheduler:  # a scheduler places the nodes
        return None
    if addr not in LOOPBACK and not addr.startswith("127."):
        return None
    return (
        f"master_addr={addr} is this host's loopback: a rehearsal of nodes={run.world.nodes} on one "
        "machine (start every node_rank here). Nodes on other machines cannot reach it: set "
        "master_addr=ADDRESS_OF_NODE_0 on every node for a real multi-node run."
    )


def check_runtime(run: Run) -> None:
    from disttrain.launch.registry import launcher_for

    _check_port_free(run)
    launcher_for(run).check_runtime(run)


def _check_port_free(run: Run) -> None:
    """The rendezvous port this launcher will host (master_port on a single node, or node 0's):
    a bind probe now, instead of a RendezvousConnectionError with a multi-node hint after the run
    dir was written. Ranks someone else launched (torchrun -m disttrain, srun) host nothing here."""
    import errno
    import os
    import socket

    from disttrain.launch.address import DEFAULT_PORT
    from disttrain.launch.registry import launcher_for

    if launcher_for(run).scheduler or ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
        return
    nodes, port = run.world.nodes, run.world.master_port
    if (nodes == 1 and not port) or (nodes > 1 and run.world.node_rank != 0):
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
                run.world.master_port,
                f"a free TCP port on this machine (port {port} is "
                f"{'in use' if taken else 'not bindable: ' + (exc.strerror or str(exc))})",
                f"another run or program listens there (`ss -ltnp 'sport = :{port}'` shows which); "
                + (
                    "use master_port=0 to pick a free one."
                    if nodes == 1
                    else "pick another port on every node."
                ),
            ) from None
