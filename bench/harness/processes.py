"""A service's processes, read from /proc (Linux): whether one is alive, and the router's
process tree (its children and theirs: a local Ray's processes and the workers)."""

from __future__ import annotations

from pathlib import Path

_PROC = Path("/proc")


def _stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command's name; [] once it is gone."""
    try:
        return (_PROC / str(pid) / "stat").read_text().rpartition(")")[2].split()
    except OSError:
        return []


def process_alive(pid: int) -> bool:
    """True while process `pid` exists and has not exited (a zombie has)."""
    state = _stat(pid)[:1]
    return bool(state) and state != ["Z"]


def process_tree(root: int) -> set[int]:
    """`root` and every process descended from it, living now."""
    children: dict[int, list[int]] = {}
    for entry in _PROC.iterdir():
        if entry.name.isdigit() and (fields := _stat(int(entry.name))):
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    tree, stack = set(), [root]
    while stack:
        pid = stack.pop()
        tree.add(pid)
        stack += children.get(pid, [])
    return tree
