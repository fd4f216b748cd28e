"""Token delivery: one long-poll per token-producing worker, updates into inboxes.

Each decode (or colocated) worker answers `next_tokens()` with every update of one or
more steps for all of its requests; the poller drops each update into its attempt's
`UpdateInbox`, applies the worker's prefix-cache changes to the routing index, and
records what the batch says about the worker's load (occupancy, step time, hand-off
time) for the local-prefill decision and, as step samples, for the planner.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from engine.core.kv_events import KVEvents
from router import phase_metrics
from router.clients import WorkerDied
from router.inbox import UpdateInbox
from router.kv_index import PrefixIndex
from router.planner.signals import ServingSignals
from router.pools import Pools, WorkerRef

log = logging.getLogger("pdserve.router")
TOKEN_POOLS = ("decode", "colocated")


class TokenDelivery:
    """Follows every live token-producing worker (new ones as they appear)."""

    def __init__(
        self,
        pools: Pools,
        indexes: dict[str, PrefixIndex],
        inbox_of: Callable[[str], UpdateInbox | None],
        signals: ServingSignals | None = None,
    ) -> None:
        self.pools = pools
        self.signals = signals
        self.indexes = indexes
        self.inbox_of = inbox_of
        self._pollers: dict[WorkerRef, asyncio.Task[None]] = {}

    def ensure_pollers(self) -> None:
        for pool in TOKEN_POOLS:
            for ref in self.pools.workers[pool]:
                if ref.state in ("live", "draining") and ref not in self._pollers:
                    self._pollers[ref] = asyncio.ensure_future(self._poll(ref))

    async def stop(self) -> None:
        tasks = list(self._pollers.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _poll(self, ref: WorkerRef) -> None:
        """One remote call per batch of steps for all of a worker's requests."""
        try:
            while ref.state in ("live", "draining", "starting"):
                try:
                    batch = await ref.client.next_tokens()
                except WorkerDied as exc:
                    self.pools.mark_dead(ref, f"{ref.worker_id} died: {exc}")
                    return
                self.apply_kv_events(ref, batch.kv_events)
                num_steps = max((len(u.new_token_ids) for u in batch.updates), default=0)
                step_s = ref.load.observe_batch(num_steps, batch.stats, time.monotonic())
                if step_s is not None and batch.stats is not None and self.signals is not None:
                    self.signals.decode_step(
                        batch.stats.num_running,
                        batch.stats.num_blocks_in_use * ref.info.layout.block_size,
                        step_s,
                    )
                for update in batch.updates:
                    if update.kv_handoff_s:
                        ref.load.handoff_s.add(update.kv_handoff_s)
                    if update.phases is not None:
                        phase_metrics.observe(ref.pool, ref.index, update.phases)
                    inbox = self.inbox_of(update.req_id)
                    if inbox is not None:
                        inbox.put(update)
        finally:
            self._pollers.pop(ref, None)

    def apply_kv_events(self, ref: WorkerRef, batches: tuple[KVEvents, ...]) -> None:
        if ref.state in ("dead", "gone"):
            return  # late news from a worker that is no longer routed to
        for events in batches:
            self.indexes[ref.pool].apply(ref.index, events)
