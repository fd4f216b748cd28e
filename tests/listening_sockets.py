"""The TCP sockets a service's processes listen on, read from /proc (Linux)."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

_PROC = Path("/proc")
_LISTEN = "0A"  # TCP state in /proc/net/tcp


@dataclass(frozen=True)
class ListeningSocket:
    pid: int
    program: str  # the process's command name (/proc/PID/comm)
    address: str  # the bound address, "0.0.0.0" or "::" for every interface
    port: int

    @property
    def loopback_only(self) -> bool:
        address = ipaddress.ip_address(self.address)
        mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1 is loopback too
        return (mapped or address).is_loopback

    def __str__(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{self.program} (pid {self.pid}) on {host}:{self.port}"


def _address(hex_address: str) -> str:
    """An address of /proc/net/tcp{,6}: little-endian 32-bit words in hex."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def _listening_inodes() -> dict[str, tuple[str, int]]:
    """socket inode → (address, port) of every listening TCP socket of this host."""
    found = {}
    for table in ("tcp", "tcp6"):
        try:
            lines = (_PROC / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == _LISTEN:
                address, port = fields[1].split(":")
                found[fields[9]] = (_address(address), int(port, 16))
    return found


def listening_sockets(pids: set[int]) -> list[ListeningSocket]:
    """Every TCP socket that one of `pids` holds open in the listening state."""
    listening = _listening_inodes()
    sockets = []
    for pid in sorted(pids):
        fd_dir = _PROC / str(pid) / "fd"
        try:
            program = (_PROC / str(pid) / "comm").read_text().strip()
            links = [os.readlink(fd_dir / fd) for fd in os.listdir(fd_dir)]
        except OSError:
            continue  # exited meanwhile
        for link in links:
            inode = link.removeprefix("socket:[").removesuffix("]")
            if link.startswith("socket:[") and inode in listening:
                sockets.append(ListeningSocket(pid, program, *listening[inode]))
    return sockets
