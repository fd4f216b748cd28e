"""Admission control: a bounded number of requests in flight and a bounded queue.

The queue is FIFO by default. With order="priority" a freed slot goes to the most
urgent waiter (lower priority value first, then arrival), and waiting ages a
request's priority by the same rule as the engine's scheduler: one level per
`aging_s` seconds waited (0 = no aging), so a stream of urgent requests cannot
starve the rest.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Literal

from router.errors import QueueFullError

AdmissionOrder = Literal["fifo", "priority"]


@dataclass
class _Waiter:
    priority: int
    enqueued_at: float
    seq: int
    granted: asyncio.Future[None] = field(repr=False)


class Admission:
    """Up to max_in_flight requests run; up to max_queue wait; the rest are refused."""

    def __init__(
        self,
        max_in_flight: int,
        max_queue: int,
        *,
        order: AdmissionOrder = "fifo",
        aging_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_in_flight < 1 or max_queue < 0:
            raise ValueError("max_in_flight must be >= 1 and max_queue >= 0")
        if order not in ("fifo", "priority"):
            raise ValueError(f"order must be 'fifo' or 'priority', got {order!r}")
        if aging_s < 0:
            raise ValueError(f"aging_s must be >= 0 (0 = no aging), got {aging_s}")
        self.max_in_flight = max_in_flight
        self.max_queue = max_queue
        self.order = order
        self.aging_s = aging_s
        self.clock = clock
        self.num_in_flight = 0
        self._waiters: list[_Waiter] = []
        self._seq = itertools.count()

    @property
    def num_queued(self) -> int:
        return len(self._waiters)

    def _rank(self, w: _Waiter, now: float) -> tuple[int, int]:
        if self.order == "fifo":
            return (0, w.seq)
        aged = int((now - w.enqueued_at) // self.aging_s) if self.aging_s > 0 else 0
        return (w.priority - aged, w.seq)

    def _acquire_now(self) -> bool:
        if self.num_in_flight < self.max_in_flight and not self._waiters:
            self.num_in_flight += 1
            return True
        return False

    def _release(self) -> None:
        # The slot passes straight to the next waiter, so nobody can cut in between.
        while self._waiters:
            now = self.clock()
            best = min(self._waiters, key=lambda w: self._rank(w, now))
            self._waiters.remove(best)
            if not best.granted.done():
                best.granted.set_result(None)
                return
        self.num_in_flight -= 1

    @asynccontextmanager
    async def slot(self, priority: int = 0) -> AsyncIterator[None]:
        """Hold an in-flight slot for the body; raises QueueFullError when over capacity.

        `priority` orders the queue only with order="priority" (lower = more urgent).
        """
        if not self._acquire_now():
            if self.num_queued >= self.max_queue:
                raise QueueFullError(
                    f"server is at capacity: {self.num_in_flight} requests in flight and "
                    f"{self.num_queued} queued (max_queue {self.max_queue}); retry later"
                )
            waiter = _Waiter(
                priority, self.clock(), next(self._seq), asyncio.get_running_loop().create_future()
            )
            self._waiters.append(waiter)
            try:
                await waiter.granted
            except asyncio.CancelledError:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
                elif waiter.granted.done() and not waiter.granted.cancelled():
                    self._release()  # granted just as we were cancelled: pass it on
                raise
        try:
            yield
        finally:
            self._release()
