"""Routing policy: pure functions over worker loads, unit-tested without Ray."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerLoadView:
    """What the router knows about one worker when it routes."""

    index: int
    alive: bool
    num_assigned: int  # requests this router has in flight on the worker
    num_blocks_free: int = 0


def pick_least_loaded(workers: Sequence[WorkerLoadView]) -> int | None:
    """Index of the live worker with the fewest in-flight requests (ties: most free
    blocks, then lowest index); None when no worker is alive."""
    live = [w for w in workers if w.alive]
    if not live:
        return None
    best = min(live, key=lambda w: (w.num_assigned, -w.num_blocks_free, w.index))
    return best.index
