"""Admission control: a bounded number of requests in flight and a bounded queue.

The queue is the engine scheduler's own (`engine.core.waiting_queue`), so the two
order requests by one rule: `fcfs` by default; with `priority` a freed slot goes to the
most urgent waiter (lower priority value first, then arrival), and waiting ages a
request's priority by one level per `aging_s` seconds waited (0 = no aging), so a
stream of urgent requests cannot starve the rest.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from typing import Protocol

from engine.core.waiting_queue import QueuePolicy, WaitingQueue
from router.serving.errors import QueueFullError


class AdmissionControl(Protocol):
    """What the serving core needs of admission: this process's `Admission`, or a router
    tier's budget shared by its processes (router/tier/shared_admission.py)."""

    @property
    def max_in_flight(self) -> int: ...
    @property
    def max_queue(self) -> int: ...
    @property
    def num_in_flight(self) -> int: ...
    @property
    def num_queued(self) -> int: ...
    def slot(self, priority: int = 0) -> AbstractAsyncContextManager[None]: ...


@dataclass(eq=False)
class Waiter:
    req_id: str  # the queue's own number for it: the request has no attempt yet
    priority: int
    arrival_time: float
    granted: asyncio.Future[None] = field(repr=False)


class WaitingLine:
    """What both admissions share: the limits, the queue of waiters (the engine
    scheduler's own, with its policy and aging) and the refusal at capacity."""

    def __init__(
        self,
        max_in_flight: int,
        max_queue: int,
        *,
        policy: QueuePolicy = "fcfs",
        aging_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_in_flight < 1 or max_queue < 0:
            raise ValueError("max_in_flight must be >= 1 and max_queue >= 0")
        self.max_in_flight = max_in_flight
        self.max_queue = max_queue
        self.clock = clock
        self._waiters: WaitingQueue[Waiter] = WaitingQueue(policy, aging_s, clock=clock)
        self._numbers = itertools.count()

    @property
    def policy(self) -> QueuePolicy:
        return self._waiters.policy

    def _full(self, running: int, queued: int) -> QueueFullError:
        return QueueFullError(
            f"server is at capacity: {running} requests in flight and "
            f"{queued} queued (max_queue {self.max_queue}); retry later"
        )

    def _new_waiter(self, priority: int) -> Waiter:
        future = asyncio.get_running_loop().create_future()
        return Waiter(str(next(self._numbers)), priority, self.clock(), future)


class Admission(WaitingLine):
    """Up to max_in_flight requests run; up to max_queue wait; the rest are refused."""

    def __init__(
        self,
        max_in_flight: int,
        max_queue: int,
        *,
        policy: QueuePolicy = "fcfs",
        aging_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(max_in_flight, max_queue, policy=policy, aging_s=aging_s, clock=clock)
        self.num_in_flight = 0

    @property
    def num_queued(self) -> int:
        return len(self._waiters)

    def _acquire_now(self) -> bool:
        if self.num_in_flight < self.max_in_flight and not self._waiters:
            self.num_in_flight += 1
            return True
        return False

    def _release(self) -> None:
        # The slot passes straight to the next waiter, so nobody can cut in between.
        waiters = self._waiters
        waiters.reorder()
        while waiters:
            best = waiters.pop_first()
            waiters.forget(best.req_id)
            if not best.granted.done():
                best.granted.set_result(None)
                return
        self.num_in_flight -= 1

    @asynccontextmanager
    async def slot(self, priority: int = 0) -> AsyncIterator[None]:
        """Hold an in-flight slot for the body; raises QueueFullError when over capacity.

        `priority` orders the queue only under the priority policy (lower = more urgent).
        """
        if not self._acquire_now():
            if self.num_queued >= self.max_queue:
                raise self._full(self.num_in_flight, self.num_queued)
            waiter = self._new_waiter(priority)
            self._waiters.push(waiter)
            try:
                await waiter.granted
            except asyncio.CancelledError:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
                    self._waiters.forget(waiter.req_id)
                elif waiter.granted.done() and not waiter.granted.cancelled():
                    self._release()  # granted just as we were cancelled: pass it on
                raise
        try:
            yield
        finally:
            self._release()
