"""Admission control: a bounded number of requests in flight and a bounded queue."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from router.errors import QueueFullError


class Admission:
    """Up to max_in_flight requests run; up to max_queue wait; the rest are refused."""

    def __init__(self, max_in_flight: int, max_queue: int) -> None:
        if max_in_flight < 1 or max_queue < 0:
            raise ValueError("max_in_flight must be >= 1 and max_queue >= 0")
        self.max_in_flight = max_in_flight
        self.max_queue = max_queue
        self._slots = asyncio.Semaphore(max_in_flight)
        self.num_in_flight = 0
        self.num_queued = 0

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold an in-flight slot for the body; raises QueueFullError when over capacity."""
        if self._slots.locked() and self.num_queued >= self.max_queue:
            raise QueueFullError(
                f"server is at capacity: {self.num_in_flight} requests in flight and "
                f"{self.num_queued} queued (max_queue {self.max_queue}); retry later"
            )
        self.num_queued += 1
        try:
            await self._slots.acquire()
        finally:
            self.num_queued -= 1
        self.num_in_flight += 1
        try:
            yield
        finally:
            self.num_in_flight -= 1
            self._slots.release()
