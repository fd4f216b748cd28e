"""A free TCP port on loopback, for services, metrics endpoints and rendezvous stores."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port nobody listens on right now (the OS picks it; it may be taken again later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
