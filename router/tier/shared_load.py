"""What every router process has on each worker, so that each routes by the service's load.

Each process counts the requests it placed on a worker and their queued prompt tokens
(router/routing/worker_load.py); without a tier that is all there is. In a tier each
process also writes its counts into a small table in memory (a file mapped by each, in
the tier's private folder, beside the admission table): per process, per worker slot
(pool and index), the incarnation's epoch, requests and queued tokens. Routing reads the
other processes' cells of the same incarnation and adds them to its own, so a process
sees a worker busy with the others' prompts as busy.

Each process writes only its own row and reads the others' without a lock; a reading
may miss a change made in the same instant elsewhere, as a count of one's own would be
a step later anyway. A worker whose index is beyond the table's slots is counted by each
process alone, as without a tier.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from engine.wire import POOLS

if TYPE_CHECKING:
    from router.fleet.worker_ref import WorkerRef

SLOTS_PER_POOL = 1024  # a pool's largest size (`pdserve scale`)
_COLUMNS = 3  # the epoch's low bits, requests, queued tokens
_EPOCH, _ASSIGNED, _QUEUED = range(_COLUMNS)
_DOUBLE = 8
_EPOCH_BITS = (1 << 52) - 1  # exact in a float64


class LoadTable:
    """The shared rows: one per router process, float64 cells in a mapped file."""

    def __init__(self, path: str, num_processes: int, *, create: bool = False) -> None:
        self.path = path
        self.num_processes = num_processes
        self._row_cells = len(POOLS) * SLOTS_PER_POOL * _COLUMNS
        size = num_processes * self._row_cells * _DOUBLE
        fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, size)  # zeros: no process holds anything
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._cells = memoryview(self._map).cast("d")

    def clear(self, row: int) -> None:
        """A process (re)starting, or gone: it holds nothing."""
        start = row * self._row_cells
        for cell in range(start, start + self._row_cells):
            self._cells[cell] = 0.0

    def share(self, row: int, pool: str, index: int, epoch: int) -> WorkerShare | None:
        """Process `row`'s cells for one worker incarnation; None past the slots."""
        if index >= SLOTS_PER_POOL:
            return None
        slot = (POOLS.index(pool) * SLOTS_PER_POOL + index) * _COLUMNS
        return WorkerShare(self, row, slot, float(epoch & _EPOCH_BITS))

    def close(self) -> None:
        self._cells.release()
        self._map.close()


class WorkerShare:
    """One process's cells for one worker incarnation, and its view of the others'
    (`router.routing.worker_load.LoadShare`)."""

    def __init__(self, table: LoadTable, row: int, slot: int, epoch: float) -> None:
        self._table = table
        self._row = row
        self._slot = slot
        self._epoch = epoch

    def publish(self, num_assigned: int, queued_tokens: int) -> None:
        cells = self._table._cells
        base = self._row * self._table._row_cells + self._slot
        cells[base + _EPOCH] = self._epoch
        cells[base + _ASSIGNED] = num_assigned
        cells[base + _QUEUED] = queued_tokens

    def others(self) -> tuple[int, int]:
        """The other processes' requests and queued tokens on this incarnation."""
        table = self._table
        cells = table._cells
        assigned = queued = 0.0
        for row in range(table.num_processes):
            if row == self._row:
                continue
            base = row * table._row_cells + self._slot
            if cells[base + _EPOCH] == self._epoch:
                assigned += cells[base + _ASSIGNED]
                queued += cells[base + _QUEUED]
        return max(int(assigned), 0), max(int(queued), 0)


class _Refs(Protocol):
    """What `LoadSharing.follow` reads of the pools (`Pools`, or a router process's
    `PoolsView`)."""

    on_live: list[Callable[[WorkerRef], None]]
    on_removed: list[Callable[[WorkerRef], None]]

    def all(self) -> list[WorkerRef]: ...


class LoadSharing:
    """Gives each worker incarnation this process routes to its cells in the table."""

    def __init__(self, table: LoadTable, row: int) -> None:
        self.table = table
        self.row = row
        table.clear(row)

    def follow(self, pools: _Refs) -> None:
        """Every worker there now, and each that goes live from now on."""
        for ref in pools.all():
            self.attach(ref)
        pools.on_live.insert(0, self.attach)
        pools.on_removed.append(self.detach)

    def attach(self, ref: WorkerRef) -> None:
        if ref.load.share is None:
            ref.load.share = self.table.share(self.row, ref.pool, ref.index, ref.info.epoch)
            ref.load.changed()

    def detach(self, ref: WorkerRef) -> None:
        # A request that ends on a removed incarnation must not overwrite its
        # successor's cells (same slot, new epoch).
        ref.load.share = None
