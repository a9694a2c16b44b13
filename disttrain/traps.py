"""Known traps of distributed setups, found from an environment report. Pure checks + cheap probes.

Each warning names the setting, what is wrong with the numbers, and ends with the fix. No torch here.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

SHM_MIN = 1 << 30  # docker's default /dev/shm is 64 MiB: NCCL's SHM transport and DataLoader workers fail
LAUNCH_VARS = ("RANK", "WORLD_SIZE")
SLOW_NCCL = {
    "NCCL_P2P_DISABLE": "GPU peer-to-peer (NVLink/PCIe) copies are off",
    "NCCL_IB_DISABLE": "InfiniBand/RoCE is off: inter-node traffic falls back to TCP sockets",
    "NCCL_SHM_DISABLE": "the shared-memory transport is off",
}


def network_interfaces() -> list[dict[str, Any]]:
    """Name, IPv4 address (if any) and state of every interface (Linux /sys + ioctl; else names only)."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return []
    return [{"name": n, "ipv4": _ipv4(n), "state": _state(n)} for n in names]


def _ipv4(name: str) -> str | None:
    try:
        import fcntl
        import struct

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
        return socket.inet_ntoa(packed[20:24])
    except (OSError, ImportError):
        return None


def _state(name: str) -> str | None:
    try:
        return Path(f"/sys/class/net/{name}/operstate").read_text().strip()
    except OSError:
        return None


def shm_bytes() -> int | None:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return st.f_frsize * st.f_blocks


def ifname_matches(spec: str, names: list[str]) -> tuple[list[str], list[str]]:
    """NCCL/Gloo `*_SOCKET_IFNAME` semantics: comma list, prefix match, `=` exact, `^` excludes.

    Returns (interfaces selected, entries that match nothing).
    """
    spec = spec.strip()
    exclude = spec.startswith("^")
    spec = spec.lstrip("^")
    exact = spec.startswith("=")
    entries = [e.strip() for e in spec.lstrip("=").split(",") if e.strip()]

    def hit(entry: str, name: str) -> bool:
        return name == entry if exact else name.startswith(entry)

    unmatched = [e for e in entries if not any(hit(e, n) for n in names)]
    selected = [n for n in names if any(hit(e, n) for e in entries) != exclude]
    return selected, unmatched


def check_traps(report: dict[str, Any], env: dict[str, str], in_rank: bool = False) -> list[str]:
    """Warnings for the report of this machine and the environment variables `env`."""
    out: list[str] = []
    cores = int(report.get("cpu_affinity") or report.get("cpu_count") or 1)
    out += _threads(env, cores, int(report.get("cpu_count") or cores))
    names = [i["name"] for i in report.get("interfaces", [])]
    for var in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        if var in env and names:
            selected, unmatched = ifname_matches(env[var], names)
            if unmatched or not selected:
                out.append(
                    f"{var}={env[var]}: {', '.join(unmatched) or 'the filter'} matches no interface on this "
                    f"host (interfaces: {', '.join(names)}). The backend fails to connect or picks another "
                    f"link. HINT: set it to one of the names above, or unset it."
                )
    for var, what in SLOW_NCCL.items():
        if env.get(var, "0") not in ("0", ""):
            out.append(
                f"{var}={env[var]}: {what}. HINT: unset it unless you are working around a known fault."
            )
    gpus = report.get("gpus") or []
    if "CUDA_VISIBLE_DEVICES" in env and not gpus and report.get("cuda"):
        out.append(
            f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']!r} but torch sees no GPU: ranks fall back to "
            "gloo on CPU. HINT: list existing device indices, or unset it."
        )
    if gpus and not report.get("backends", {}).get("nccl"):
        out.append(
            f"{len(gpus)} GPUs but torch has no NCCL: GPU training uses gloo. HINT: install a CUDA build."
        )
    shm = report.get("shm_bytes")
    if shm is not None and shm < SHM_MIN:
        out.append(
            f"/dev/shm is {shm / 2**20:.0f} MiB (< 1 GiB): NCCL's shared-memory transport and DataLoader "
            "workers fail with bus errors. HINT: docker run --shm-size=16g (or --ipc=host)."
        )
    if not in_rank:
        set_vars = [v for v in LAUNCH_VARS if v in env]
        if len(set_vars) == len(LAUNCH_VARS):
            out.append(
                f"RANK={env['RANK']} and WORLD_SIZE={env['WORLD_SIZE']} are set in this shell: `disttrain train` "
                "will believe it is an already-launched rank and wait for its peers. HINT: unset RANK WORLD_SIZE."
            )
    if "MASTER_ADDR" in env and not _resolves(env["MASTER_ADDR"]):
        out.append(
            f"MASTER_ADDR={env['MASTER_ADDR']} does not resolve on this host: rendezvous will hang until "
            "it times out. HINT: use an IP address or a name in /etc/hosts."
        )
    return out


def gloo_across_nodes(what: str, nodes: int, env: Mapping[str, str], interfaces: list[str]) -> str | None:
    """A warning when `what` (a gloo group) spans `nodes` nodes but only NCCL was told its interface.

    Clusters tune NCCL_SOCKET_IFNAME; gloo reads GLOO_SOCKET_IFNAME only and otherwise binds to the
    address the hostname resolves to, often a management or container network the other nodes
    cannot reach, so creating the group hangs or fails at start (review 2026-11-25-gpu-readiness #18).
    """
    nccl = env.get("NCCL_SOCKET_IFNAME", "")
    if nodes < 2 or not nccl or "GLOO_SOCKET_IFNAME" in env:
        return None
    selected, _ = ifname_matches(nccl, interfaces)
    # gloo takes exact names, comma-separated: NCCL's prefixes and exclusions resolved on this host
    names = ",".join(selected) if selected and (nccl.startswith(("^", "=")) or selected != [nccl]) else nccl
    return (
        f"NCCL_SOCKET_IFNAME={nccl} is set but GLOO_SOCKET_IFNAME is not: {what} spans {nodes} nodes over "
        "gloo, which ignores NCCL's setting and uses the interface the hostname resolves to; if the "
        "nodes cannot reach each other there, the group hangs or fails at start. HINT: export "
        f"GLOO_SOCKET_IFNAME={names} on every node (gloo wants exact interface names)."
    )


def warn_gloo_across_nodes(what: str, world_size: int, local_world_size: int) -> str | None:
    """Log `gloo_across_nodes` for this process's environment (once per node: local rank 0 calls)."""
    nodes = world_size // max(1, local_world_size)
    names = [i["name"] for i in network_interfaces()] if nodes > 1 else []
    warning = gloo_across_nodes(what, nodes, os.environ, names)
    if warning:
        logging.getLogger("disttrain").warning(warning)
    return warning


def _threads(env: dict[str, str], cores: int, cpu_count: int) -> list[str]:
    out = []
    omp = env.get("OMP_NUM_THREADS", "")
    local = int(env.get("LOCAL_WORLD_SIZE", "1") or 1)
    if omp.isdigit() and int(omp) * local > cores:
        out.append(
            f"OMP_NUM_THREADS={omp} x {local} local ranks = {int(omp) * local} threads on {cores} cores: "
            f"oversubscribed, CPU ops run 2-3x slower. HINT: OMP_NUM_THREADS={max(1, cores // local)} "
            "(disttrain sets cores / local ranks when you leave threads_per_rank=null)."
        )
    if cores < cpu_count:
        out.append(
            f"this process may use {cores} of {cpu_count} cores (taskset/cgroup affinity): size threads and "
            f"ranks by {cores}, not os.cpu_count(). HINT: disttrain already does; check your own scripts."
        )
    return out


def _resolves(host: str) -> bool:
    try:
        socket.getaddrinfo(host, None)
    except (OSError, UnicodeError):
        return False
    return True
