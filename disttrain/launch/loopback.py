"""Single-node stores that only this machine can reach.

torch's TCPStore server binds every interface (`*:port`) whatever host name it is given: a
`TCPStore("127.0.0.1", 0, is_master=True)` accepts clients from the network, which could read or
set rendezvous keys (gloo's address exchange) or stall the run. TCPStore does listen on a socket
it is handed (`master_listen_fd`), so a single-node run binds 127.0.0.1 itself and passes the fd:
for spawn's store, for torchrun's rendezvous store and for the store the agent shares with the
ranks (a rendezvous backend registered as `disttrain-loopback`). Several nodes need a reachable
store; see README, "Trust boundary".
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any

LOOPBACK = "127.0.0.1"
BACKEND = "disttrain-loopback"


def loopback_store(port: int = 0, **kwargs: Any) -> Any:
    """A TCPStore server listening on 127.0.0.1 only (port 0: a free one; `.port` tells which)."""
    from torch.distributed import TCPStore

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((LOOPBACK, port))
        sock.listen(socket.SOMAXCONN)
        port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    return TCPStore(LOOPBACK, port, is_master=True, master_listen_fd=sock.detach(), **kwargs)


def _create_handler(params: Any) -> Any:
    """torchrun's c10d rendezvous on one node, with both of its stores bound to loopback."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    _, port = parse_rendezvous_endpoint(params.endpoint, default_port=0)
    read_timeout = timedelta(seconds=int(params.get_as_int("read_timeout", 60) or 60))
    store = loopback_store(port, wait_for_workers=False, timeout=read_timeout)

    class LoopbackBackend(C10dRendezvousBackend):
        @property
        def name(self) -> str:  # the registry checks the handler's backend against the name asked for
            return BACKEND

    handler = create_handler(store, LoopbackBackend(store, params.run_id), params)
    # The store the agent shares with its ranks (MASTER_ADDR/PORT of init_process_group): torch
    # makes it with TCPStore(addr, 0, is_master=True), i.e. on every interface; make it here.
    handler._create_tcp_store_server = _shared_store  # type: ignore[method-assign,assignment]
    return handler


def _shared_store(addr: str, port: int) -> Any:
    return loopback_store(port, wait_for_workers=False)


def register_backend() -> str:
    """Register the `disttrain-loopback` rendezvous backend (idempotent); returns its name."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(BACKEND, _create_handler)
    return BACKEND
