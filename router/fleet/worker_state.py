"""Where a worker incarnation is in its life, as the router sees it (router/fleet/pools.py):

  starting → live (routable) → draining (no new work) → gone
  any state → dead (the actor died)

A member is its plain string everywhere: log lines, metric labels, the admin API.
"""

from __future__ import annotations

from enum import StrEnum


class WorkerState(StrEnum):
    STARTING = "starting"  # placed, loading its model, pairing with peers
    LIVE = "live"  # routable
    DRAINING = "draining"  # takes no new work; its requests finish or move
    DEAD = "dead"  # its actor died
    GONE = "gone"  # drained, or stopped with the pools

    @property
    def serving(self) -> bool:
        """It still has requests to answer for: live or draining."""
        return self in (WorkerState.LIVE, WorkerState.DRAINING)

    @property
    def ended(self) -> bool:
        """No longer there to call: dead or gone."""
        return self in (WorkerState.DEAD, WorkerState.GONE)
