"""The service's own ports, bound before Ray starts and kept until its servers listen.

Starting Ray spawns a dozen processes, and each takes ports of its own from the same
range the kernel hands out as "free" ones. A port checked free before Ray started can be
taken by one of them before the router's gRPC or metrics server binds it (a caller that
picked a free port for the service then reaches a Ray process instead). So the port is
bound here, not listening, before Ray starts, and each server releases its port right
before it binds it. One service per process: the holds are this process's.
"""

from __future__ import annotations

import errno
import socket

_held: dict[tuple[str, int], socket.socket] = {}


def hold(host: str, port: int | None) -> str | None:
    """Bind host:port and keep it until `release`; why it cannot be had, or None.
    Port 0 (any free port, picked when the server binds) or none holds nothing."""
    if not port or (host, port) in _held:
        return None
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        try:
            # Without SO_REUSEADDR: another socket (grpc sets it) cannot share the port.
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            # Perhaps only TIME_WAIT connections of a past run, which grpc binds over, as
            # this does; a live listener still refuses it.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            return f"{where} is in use"
        return f"cannot listen on {where}: {exc.strerror or exc}"
    _held[(host, port)] = sock
    return None


def check(host: str, port: int) -> str | None:
    """Why host:port could not be had now, or None; holds nothing (a flag's check)."""
    if (host, port) in _held:
        return None
    problem = hold(host, port)
    if problem is None:
        release(host, port)
    return problem


def release(host: str, port: int) -> None:
    """Let go of a held port (its server binds it next); nothing when it is not held."""
    sock = _held.pop((host, port), None)
    if sock is not None:
        sock.close()


def release_all() -> None:
    """Let go of every port still held (the service stops, or never started)."""
    for key in list(_held):
        release(*key)
