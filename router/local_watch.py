"""Shutdown: notice the local Ray going down with the process group, without asking Ray.

A SIGTERM sent to the service's whole process group (`kill -- -PGID`, a control-group
stop) reaches the processes of the local Ray this router started (its GCS, raylet,
dashboard, ...: children of the router, in its group). From then on every call to a
worker hangs, so streams in flight would wait out the whole drain grace for tokens that
never come. While the router drains, it therefore watches its own child processes: when
one of them exits, the signal went to the group and Ray is going down, and the drain
ends at once, each stream with its final ABORT. A SIGTERM to the router alone leaves
them running, and in-flight requests get the grace to finish.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path

WATCH_PERIOD_S = 0.2
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


def live_children(parent: int) -> dict[int, str]:
    """pid → command line (NUL-separated) of `parent`'s running children (Linux; else
    none)."""
    children: dict[int, str] = {}
    if not _PROC.is_dir():
        return children
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        if fields is not None and fields[0] != "Z" and fields[1] == str(parent):
            try:
                children[int(entry.name)] = (
                    (entry / "cmdline").read_bytes().decode(errors="replace")
                )
            except OSError:
                continue
    return children


def ray_children(parent: int) -> dict[int, str]:
    """pid → program of `parent`'s running children that belong to Ray (GCS, raylet,
    dashboard, log monitor: programs from Ray's package)."""
    found = {}
    for pid, cmdline in live_children(parent).items():
        args = cmdline.split("\0")
        program = next((a for a in args if f"{os.sep}ray{os.sep}" in a), None)
        if program is not None:
            found[pid] = Path(program).name
    return found


async def watch_children(on_exit: Callable[[str], None], period_s: float = WATCH_PERIOD_S) -> None:
    """Call `on_exit(why)` once one of Ray's processes that were this process's children
    when the watch began has exited; returns then (or at once when there are none)."""
    children = ray_children(os.getpid())
    while children:
        for pid, name in children.items():
            if not process_alive(pid):
                on_exit(f"{name} (pid {pid}) exited: the signal reached the process group")
                return
        await asyncio.sleep(period_s)
