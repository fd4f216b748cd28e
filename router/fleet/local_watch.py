"""Shutdown: notice the local Ray going down with the service, without asking Ray.

The local Ray runs in a session of its own (`router.fleet.local_ray`), so a signal to the
service's process group reaches the router alone. A stop that signals every process of
the service anyway (systemd's default control-group stop, a container runtime's) also
reaches Ray's GCS, raylet and workers, in whatever order; from then on every call to a
worker hangs, and streams in flight would wait out the whole drain grace for tokens that
never come. From Ray's start the router therefore watches Ray's own processes (the
launcher and its children): when one of them exits, Ray is going down, and the drain
ends at once (or starts, if the router's own signal is still on its way), each stream
with its final ABORT, and nothing more is asked of Ray.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

WATCH_PERIOD_S = 0.1
_PROC = Path("/proc")


def _stat_fields(pid: int) -> list[str] | None:
    """The fields after the command name of /proc/PID/stat (state, ppid, ...)."""
    try:
        stat = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()  # the name may hold spaces and parentheses


def process_alive(pid: int) -> bool:
    """True while process `pid` exists and is not a zombie (exited, not yet reaped)."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def _name(pid: int) -> str:
    try:
        return (_PROC / str(pid) / "comm").read_text().strip()
    except OSError:
        return "?"


def ray_daemons(launcher: int) -> dict[int, str]:
    """pid → command name of the local Ray's launcher and its running children (GCS,
    raylet, log monitor, ...); not the workers, which come and go on their own."""
    found = {launcher: _name(launcher)} if process_alive(launcher) else {}
    if not _PROC.is_dir():
        return found
    for entry in _PROC.iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields is not None and fields[0] != "Z" and fields[1] == str(launcher):
                found[int(entry.name)] = _name(int(entry.name))
    return found


async def watch_processes(
    processes: dict[int, str],
    on_exit: Callable[[str], None],
    period_s: float = WATCH_PERIOD_S,
) -> None:
    """Call `on_exit(why)` once one of `processes` (pid → name) has exited; returns then
    (or at once when there are none)."""
    while processes:
        for pid, name in processes.items():
            if not process_alive(pid):
                on_exit(f"{name} (pid {pid}) of the local Ray exited")
                return
        await asyncio.sleep(period_s)
