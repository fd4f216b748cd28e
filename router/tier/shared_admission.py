"""Admission for the whole router tier: one budget of running and waiting requests
shared by every router process.

`--max-in-flight` and `--max-queue` are the service's, not each process's. The
processes share a small table in memory (a file mapped by each, in the tier's private
folder): per process, its requests running and waiting, and its most urgent waiter's
key. A process admits a request when the table's total running is under the limit and
no waiter anywhere comes before it; refuses one (RESOURCE_EXHAUSTED) when the table's
total waiting is at `--max-queue`; and, while it has waiters, looks at the table every
`POLL_S` for a freed slot its head may take, since a slot freed by another process is
not handed over directly.

Each process writes only its own row and reads the others without a lock, so two
processes deciding in the same instant may both take the last slot: the tier may run
up to `--max-in-flight` + (processes − 1) requests, and queue as many more than
`--max-queue`. That is the slack (docs/architecture.md, Router tier). Ordering among
processes follows the same rule as within one (`fcfs`, or `priority` with aging): the
waiter whose key is smallest goes first, ties broken by arrival then process index.
"""

from __future__ import annotations

import asyncio
import math
import mmap
import os
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from engine.core.waiting_queue import QueuePolicy
from router.serving.admission import WaitingLine

POLL_S = 0.002  # how often a process with waiters looks for a slot freed elsewhere
_COLUMNS = 4  # running, waiting, head key, head arrival (NaN: no waiter)
_RUNNING, _WAITING, _HEAD_KEY, _HEAD_ARRIVAL = range(_COLUMNS)
_DOUBLE = 8


class AdmissionTable:
    """The shared rows: one per router process, float64 cells in a mapped file."""

    def __init__(self, path: str, num_processes: int, *, create: bool = False) -> None:
        self.path = path
        self.num_processes = num_processes
        size = num_processes * _COLUMNS * _DOUBLE
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._cells = memoryview(self._map).cast("d")
        if create:
            for row in range(num_processes):
                self.clear(row)

    def clear(self, row: int) -> None:
        """A process (re)starting: it holds nothing yet."""
        base = row * _COLUMNS
        self._cells[base + _RUNNING] = 0.0
        self._cells[base + _WAITING] = 0.0
        self._cells[base + _HEAD_KEY] = math.nan
        self._cells[base + _HEAD_ARRIVAL] = math.nan

    def add(self, row: int, column: int, delta: float) -> None:
        self._cells[row * _COLUMNS + column] += delta

    def set_head(self, row: int, key: float | None, arrival: float) -> None:
        base = row * _COLUMNS
        self._cells[base + _HEAD_KEY] = math.nan if key is None else key
        self._cells[base + _HEAD_ARRIVAL] = arrival

    def total(self, column: int) -> int:
        cells = self._cells
        return int(sum(cells[row * _COLUMNS + column] for row in range(self.num_processes)))

    def first_waiter_elsewhere(self, row: int) -> tuple[float, float, int] | None:
        """The most urgent head of the other processes' queues: (key, arrival, row)."""
        cells = self._cells
        best: tuple[float, float, int] | None = None
        for other in range(self.num_processes):
            if other == row:
                continue
            key = cells[other * _COLUMNS + _HEAD_KEY]
            if math.isnan(key):
                continue
            head = (key, cells[other * _COLUMNS + _HEAD_ARRIVAL], other)
            if best is None or head < best:
                best = head
        return best

    def close(self) -> None:
        self._cells.release()
        self._map.close()


@dataclass(eq=False)
class SharedAdmission(WaitingLine):
    """`router.serving.admission.Admission`'s interface over the tier's shared table."""

    def __init__(
        self,
        table: AdmissionTable,
        row: int,
        max_in_flight: int,
        max_queue: int,
        *,
        policy: QueuePolicy = "fcfs",
        aging_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(max_in_flight, max_queue, policy=policy, aging_s=aging_s, clock=clock)
        self.table = table
        self.row = row
        self._watcher: asyncio.Task[None] | None = None
        self.num_local_in_flight = 0
        table.clear(row)

    @property
    def num_in_flight(self) -> int:
        """Running in the whole tier."""
        return self.table.total(_RUNNING)

    @property
    def num_queued(self) -> int:
        """Waiting in the whole tier."""
        return self.table.total(_WAITING)

    # ---------------------------------------------------------------- slots
    def _take_slot(self) -> None:
        self.num_local_in_flight += 1
        self.table.add(self.row, _RUNNING, 1)

    def _free_slot(self) -> None:
        self.num_local_in_flight -= 1
        self.table.add(self.row, _RUNNING, -1)

    def _room(self) -> bool:
        return self.table.total(_RUNNING) < self.max_in_flight

    def _publish_head(self) -> None:
        if not self._waiters:
            self.table.set_head(self.row, None, math.nan)
            return
        self._waiters.reorder()
        first = self._waiters.first()
        key = self._waiters.key(first)
        self.table.set_head(self.row, key[0], first.arrival_time)

    def _head_goes_first(self) -> bool:
        """This process's first waiter comes before every other process's."""
        first = self._waiters.first()
        key = self._waiters.key(first)
        mine = (key[0], first.arrival_time, self.row)
        other = self.table.first_waiter_elsewhere(self.row)
        return other is None or mine < other

    def _grant_waiters(self) -> None:
        """Give freed slots to this process's waiters, the most urgent first, while the
        tier has room and no other process's waiter comes before them."""
        waiters = self._waiters
        while waiters:
            waiters.reorder()
            if not self._room() or not self._head_goes_first():
                break
            best = waiters.pop_first()
            waiters.forget(best.req_id)
            self.table.add(self.row, _WAITING, -1)
            if best.granted.done():
                continue  # cancelled meanwhile
            self._take_slot()
            best.granted.set_result(None)
        self._publish_head()

    async def _watch(self) -> None:
        """While this process has waiters: slots freed by other processes."""
        try:
            while self._waiters:
                await asyncio.sleep(POLL_S)
                self._grant_waiters()
        finally:
            self._watcher = None

    @asynccontextmanager
    async def slot(self, priority: int = 0) -> AsyncIterator[None]:
        """Hold a running slot of the tier for the body; QueueFullError when the tier's
        queue is full."""
        free_now = (
            not self._waiters
            and self._room()
            and self.table.first_waiter_elsewhere(self.row) is None
        )
        if free_now:
            self._take_slot()
        else:
            if self.table.total(_WAITING) >= self.max_queue:
                raise self._full(self.num_in_flight, self.num_queued)
            waiter = self._new_waiter(priority)
            self._waiters.push(waiter)
            self.table.add(self.row, _WAITING, 1)
            self._publish_head()
            if self._watcher is None:
                self._watcher = asyncio.ensure_future(self._watch())
            try:
                await waiter.granted
            except asyncio.CancelledError:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
                    self._waiters.forget(waiter.req_id)
                    self.table.add(self.row, _WAITING, -1)
                    self._publish_head()
                elif waiter.granted.done() and not waiter.granted.cancelled():
                    self._free_slot()  # granted just as it was cancelled
                    self._grant_waiters()
                raise
        try:
            yield
        finally:
            self._free_slot()
            if self._waiters:
                self._grant_waiters()
