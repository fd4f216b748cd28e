"""Aging for the priority policy, so that a steady stream of urgent requests cannot
starve a less urgent one forever.

Rule: a request's effective priority is its priority minus one level for every
`aging_interval_s` seconds it has spent waiting (lower value = more urgent). Only
time in the waiting queue counts; a running request keeps the effective priority
it was admitted with. So a preempted request always ranks behind the request that
preempted it and cannot bounce it straight back, yet it keeps gaining a level per
interval while it waits again.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from engine.core.request import Request


class PriorityAging:
    """Wait time per request and the effective priority it earns; inert when off."""

    def __init__(
        self, aging_interval_s: float, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.aging_interval_s = aging_interval_s
        self.clock = clock
        self._waited_s: dict[str, float] = {}  # finished waiting periods
        self._waiting_since: dict[str, float] = {}

    @property
    def enabled(self) -> bool:
        return self.aging_interval_s > 0

    def start_waiting(self, req_id: str) -> None:
        if self.enabled:
            self._waiting_since[req_id] = self.clock()

    def stop_waiting(self, req_id: str) -> None:
        since = self._waiting_since.pop(req_id, None)
        if since is not None:
            self._waited_s[req_id] = self._waited_s.get(req_id, 0.0) + self.clock() - since

    def forget(self, req_id: str) -> None:
        self._waited_s.pop(req_id, None)
        self._waiting_since.pop(req_id, None)

    def waited_s(self, req_id: str) -> float:
        """Seconds the request has spent waiting, over all its waiting periods."""
        since = self._waiting_since.get(req_id)
        ongoing = 0.0 if since is None else self.clock() - since
        return self._waited_s.get(req_id, 0.0) + ongoing

    def effective_priority(self, req: Request) -> int:
        """The priority the request is ranked by now (lower = more urgent)."""
        if not self.enabled:
            return req.priority
        return req.priority - int(self.waited_s(req.req_id) // self.aging_interval_s)
