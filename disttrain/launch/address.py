"""Where the nodes meet: the rendezvous endpoint of a run, and this machine's address on the route
to it. Read by the roll call (multinode), the waiting lines (waiting) and torchrun's rendezvous.
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from disttrain.config.run import Run

DEFAULT_PORT = 29500

__all__ = ["DEFAULT_PORT", "endpoint", "local_address"]


def endpoint(run: Run) -> tuple[str, int]:
    """(master_addr, master_port) of the run's rendezvous, the port defaulting to torch's 29500."""
    return str(run.world.master_addr), int(run.world.master_port or DEFAULT_PORT)


def local_address(master_addr: str, port: int) -> str:
    """This machine's address on the route to master_addr (what the other nodes can reach)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((master_addr, port))  # UDP: no packet is sent, only a route is chosen
            return str(s.getsockname()[0])
        except OSError:
            return socket.getfqdn()
