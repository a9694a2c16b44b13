"""D6: single-node rendezvous stores listen on 127.0.0.1 only (torch's TCPStore binds `*:port`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/net/tcp")


def _listeners() -> list[tuple[str, int, str]]:
    """(address, port, inode) of every listening TCP socket, IPv4 and IPv6, from /proc/net/tcp*."""
    rows = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            addr, _, hexport = fields[1].partition(":")
            if fields[3] == "0A":  # LISTEN
                shown = "127.0.0.1" if addr == "0100007F" else "any" if int(addr, 16) == 0 else addr
                rows.append((shown, int(hexport, 16), fields[9]))
    return rows


def listening_addresses(port: int) -> set[str]:
    return {addr for addr, p, _ in _listeners() if p == port}


def own_listeners() -> set[tuple[str, int]]:
    """The listening sockets this process holds (matched by inode through /proc/self/fd)."""
    inodes = set()
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return {(addr, port) for addr, port, inode in _listeners() if inode in inodes}


def test_torch_tcpstore_alone_listens_everywhere() -> None:
    """Why this module exists: if this starts failing, torch binds the host it is given."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, world_size=1, is_master=True, wait_for_workers=False)
    assert listening_addresses(store.port) == {"any"}


def test_loopback_store_listens_on_loopback_only() -> None:
    from torch.distributed import TCPStore

    from disttrain.launch.loopback import loopback_store

    store = loopback_store(world_size=1, wait_for_workers=False)
    assert listening_addresses(store.port) == {"127.0.0.1"}
    client = TCPStore("127.0.0.1", store.port, is_master=False, wait_for_workers=False)
    client.set("k", "v")
    assert store.get("k") == b"v"


@pytest.mark.timeout(120)
def test_torchrun_rendezvous_stores_listen_on_loopback_only() -> None:
    """Both stores of the single-node rendezvous: the c10d backend's and the one shared with ranks."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    from disttrain.launch.loopback import register_backend

    params = RendezvousParameters(
        register_backend(), "127.0.0.1:0", "test-loopback", 1, 1, local_addr="127.0.0.1", last_call_timeout=1
    )
    before = own_listeners()
    handler = get_rendezvous_handler(params)
    info = handler.next_rendezvous()
    try:
        shared = info.bootstrap_store_info
        assert (shared.master_addr, info.rank, info.world_size) == ("127.0.0.1", 0, 1)
        assert listening_addresses(shared.master_port) == {"127.0.0.1"}
        opened = own_listeners() - before
        assert len(opened) == 2, opened  # the rendezvous store and the one shared with the ranks
        assert {addr for addr, _ in opened} == {"127.0.0.1"}, opened
    finally:
        handler.shutdown()
