"""Free TCP ports on loopback, for services, metrics endpoints and rendezvous stores."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port nobody listens on right now (the OS picks it; it may be taken again later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port_run(n: int) -> int:
    """A free port p with p + 1 .. p + n - 1 free too: a router tier of n processes
    serves /metrics on p + i from process i."""
    for _ in range(100):
        base = free_port()
        try:
            for i in range(1, n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", base + i))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no {n} consecutive free ports")
