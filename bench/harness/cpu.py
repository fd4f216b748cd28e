"""CPU time a service spends, read from /proc (Linux): its router process alone, or the
router and its worker actors together."""

from __future__ import annotations

import os

WORKER_ACTORS = (b"ray::PrefillWorker", b"ray::DecodeWorker", b"ray::ColocatedWorker")


def _stat(pid: int | str) -> tuple[int, float]:
    """(parent pid, user + system CPU seconds) of one process."""
    with open(f"/proc/{pid}/stat") as f:
        # The command name (field 2) may hold spaces: split after its ')'.
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process so far (its threads included)."""
    return _stat(pid)[1]


def service_cpu_s(root_pid: int) -> float:
    """User + system CPU seconds of a service's router (`root_pid`) and its worker
    actors (descendants whose command line names a worker class; not Ray's daemons)."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    counted: set[int] = {root_pid}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            parents[int(entry)], times[int(entry)] = _stat(entry)
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if f.read().startswith(WORKER_ACTORS):
                    counted.add(int(entry))
        except OSError:
            continue  # exited meanwhile
    total, stack = 0.0, [root_pid]
    while stack:
        pid = stack.pop()
        total += times.get(pid, 0.0) if pid in counted else 0.0
        stack += [child for child, parent in parents.items() if parent == pid]
    return total
