"""Decode reservations kept alive while their requests legitimately wait.

A decode worker frees a reservation whose lease runs out (`--reservation-lease-s`). The
router renews, in one `renew` call per decode worker every lease/3, the reservations of
every request that is queued or prefilling, or whose KV is still on its way: waiting is
never a failure. The serving core adds a request when it reserves and removes it when
the decode worker first answers for it (the KV landed, or was refused) or the attempt
ends.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from router.fleet.clients import WorkerDied
from router.serving.workers import Pools, WorkerRef


class LeaseRenewer:
    def __init__(self, pools: Pools, lease_s: float, spawn: Callable[[Any], None]) -> None:
        self.pools = pools
        self.lease_s = lease_s
        self.spawn = spawn
        # Reservations to keep, by decode worker (request ids).
        self.renewing: dict[WorkerRef, set[str]] = defaultdict(set)
        self._task: asyncio.Task[None] | None = None

    def hold(self, ref: WorkerRef, req_id: str) -> None:
        """Renew `req_id`'s reservation on `ref` until released."""
        self.renewing[ref].add(req_id)

    def release(self, ref: WorkerRef, req_id: str) -> None:
        """Renew it no more (the KV landed, or the attempt ended)."""
        self.renewing[ref].discard(req_id)

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        period = max(self.lease_s / 3, 0.05)
        while True:
            await asyncio.sleep(period)
            for ref, req_ids in list(self.renewing.items()):
                if ref.state.ended:
                    del self.renewing[ref]  # its reservations went with it
                elif req_ids:
                    self.spawn(self._renew(ref, list(req_ids)))

    async def _renew(self, ref: WorkerRef, req_ids: list[str]) -> None:
        try:
            await ref.client.renew(req_ids, self.lease_s)
        except WorkerDied as exc:
            self.pools.mark_dead(ref, f"{ref.worker_id} died: {exc}")
