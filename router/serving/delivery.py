"""Token delivery: one long-poll per token-producing worker, updates into inboxes.

Each decode (or colocated) worker answers `next_tokens()` with every update of one or
more steps for all of its requests; the poller drops each update into its attempt's
`UpdateInbox`, applies the worker's prefix-cache changes to the routing index, and
records what the batch says about the worker's load (occupancy, step time, hand-off
time) for the local-prefill decision; its step times and the requests' phase reports go
to the serving core's observers (the planner's signals, the phase metrics).

With many streams open (`LOADED_FROM_STREAMS`) the poller hands the event loop back after
each update that wakes a stream, so one turn of the loop runs one woken stream rather
than all of them. A gRPC server takes in one new call per turn of its loop: with 128
streams woken in one turn, a turn lasts the whole batch's work (detokenize, message,
write for each) and new calls queue behind it; in short turns they come in between. The
price is fewer, larger messages: the next poll waits for the batch's streams, so each
update carries more steps and a stream's messages come further apart, while the router
streams more tokens a second and new calls wait far less to be accepted. Under that many
streams, `--stream-interval auto` already trades per-token messages for the loop's
capacity; below it nothing changes.

In a router tier it also long-polls each prefill worker for its prefix-cache changes
(`next_kv_events`): the reply to a prompt carries them too, but only to the process that
sent the prompt, and a session's next turn that lands on another process must still find
the prefill worker that holds its previous turn.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sized

from engine.wire import KVEvents, PoolName
from router.edge.streams import AUTO_FROM_STREAMS
from router.fleet.clients import WorkerDied
from router.fleet.worker_state import WorkerState
from router.routing.kv_index import PrefixIndex
from router.serving.events import BaseObserver, RequestObserver
from router.serving.inbox import UpdateInbox
from router.serving.workers import Pools, WorkerRef

# Open streams from which the poller yields between woken streams (see the module doc):
# where `--stream-interval auto` starts to merge tokens, the loop being the limit.
LOADED_FROM_STREAMS = AUTO_FROM_STREAMS

log = logging.getLogger(__name__)
TOKEN_POOLS = (PoolName.DECODE, PoolName.COLOCATED)


class TokenDelivery:
    """Follows every live token-producing worker (new ones as they appear)."""

    def __init__(
        self,
        pools: Pools,
        indexes: dict[PoolName, PrefixIndex],
        inbox_of: Callable[[str], UpdateInbox | None],
        observer: RequestObserver | None = None,
        streams: Sized = (),
    ) -> None:
        self.pools = pools
        self.observer = observer or BaseObserver()
        self.indexes = indexes
        self.inbox_of = inbox_of
        self.streams = streams  # the requests in flight: len() is the open streams
        self._pollers: dict[WorkerRef, asyncio.Task[None]] = {}
        self._stopped = False

    def ensure_pollers(self) -> None:
        for ref in self.pools.all():
            self.follow(ref)

    def follow(self, ref: WorkerRef) -> None:
        """Poll this worker's tokens (a prefill worker's cache changes, in a tier), unless
        that is done already. The pools call it as a worker goes live (`Pools.on_live`):
        a request that waited for a replacement is submitted to it at once, and its tokens
        must not wait for other traffic to start the poll."""
        if self._stopped or ref in self._pollers or not ref.state.serving:
            return
        if ref.pool in TOKEN_POOLS:
            self._pollers[ref] = asyncio.ensure_future(self._poll(ref))
            return
        # Only a tier's clients name a consumer: alone, the router sends every prompt
        # itself and the replies carry every change.
        consumer: str = getattr(ref.client, "consumer", "")
        if ref.pool is PoolName.PREFILL and consumer:
            self._pollers[ref] = asyncio.ensure_future(self._poll_kv_events(ref))

    async def stop(self) -> None:
        self._stopped = True
        tasks = list(self._pollers.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _poll(self, ref: WorkerRef) -> None:
        """One remote call per batch of steps for all of a worker's requests."""
        try:
            while ref.state.serving or ref.state is WorkerState.STARTING:
                try:
                    batch = await ref.client.next_tokens()
                except WorkerDied as exc:
                    self.pools.mark_dead(ref, f"{ref.worker_id} died: {exc}")
                    return
                self.apply_kv_events(ref, batch.kv_events)
                num_steps = max((len(u.new_token_ids) for u in batch.updates), default=0)
                step_s = ref.load.observe_batch(num_steps, batch.stats, time.monotonic())
                if step_s is not None and batch.stats is not None:
                    self.observer.decode_step(ref, batch.stats, step_s)
                loaded = len(self.streams) >= LOADED_FROM_STREAMS
                for update in batch.updates:
                    if update.kv_handoff_s:
                        ref.load.handoff_s.add(update.kv_handoff_s)
                    if update.phases is not None:
                        self.observer.phases(ref, update.phases)
                    inbox = self.inbox_of(update.req_id)
                    if inbox is not None and inbox.put(update) and loaded:
                        await asyncio.sleep(0)  # the loop runs that stream, or takes a call
        finally:
            self._pollers.pop(ref, None)

    async def _poll_kv_events(self, ref: WorkerRef) -> None:
        try:
            while ref.state.serving:
                try:
                    batches = await ref.client.next_kv_events()
                except WorkerDied:
                    return  # the prefill call that meets it marks it dead
                self.apply_kv_events(ref, batches)
        finally:
            self._pollers.pop(ref, None)

    def apply_kv_events(self, ref: WorkerRef, batches: tuple[KVEvents, ...]) -> None:
        if ref.state.ended:
            return  # late news from a worker that is no longer routed to
        for events in batches:
            self.indexes[ref.pool].apply(ref.index, events)
