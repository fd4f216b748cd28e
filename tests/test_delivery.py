"""The token poller under many streams: a batch's woken streams run between its puts, so
the event loop turns often enough to take in new calls; under few, it delivers at once."""

from __future__ import annotations

import asyncio
from typing import Any

from bench.fake_workers import FakePools, FakeWorker
from engine.wire import POOLS, KVEvents, PoolName, TokenBatch, TokenUpdate
from router.fleet.worker_ref import WorkerRef
from router.fleet.worker_state import WorkerState
from router.routing.kv_index import PrefixIndex
from router.serving.delivery import LOADED_FROM_STREAMS, TokenDelivery
from router.serving.inbox import UpdateInbox


class _OneBatch(FakeWorker):
    """A decode worker whose first poll answers `batch`; by the second it has left (its
    ref gone), which ends the poller."""

    def __init__(self, ref: WorkerRef, batch: TokenBatch) -> None:
        super().__init__(ref.worker_id)
        self._ref, self._batch = ref, batch

    async def next_tokens(self) -> TokenBatch:
        batch, self._batch = self._batch, TokenBatch(())
        if not batch.updates:
            self._ref.state = WorkerState.GONE
        return batch


def _order_of_events(num_streams: int) -> list[str]:
    """Poll one batch with a token for each of `num_streams` waiting streams; the order
    in which the poller's puts and the streams' wake-ups happened."""
    log: list[str] = []

    class LoggedInbox(UpdateInbox):
        def put(self, item: Any) -> bool:
            log.append("put")
            return super().put(item)

    async def main() -> None:
        inboxes = {f"r{i}": LoggedInbox() for i in range(num_streams)}

        async def stream(inbox: UpdateInbox) -> None:
            await inbox.take(5.0)
            log.append("took")

        readers = [asyncio.ensure_future(stream(inbox)) for inbox in inboxes.values()]
        await asyncio.sleep(0)  # every stream waits on its inbox
        pools = FakePools(0, 1)
        ref = pools.workers[PoolName.DECODE][0]
        batch = TokenBatch(tuple(TokenUpdate(req_id, (7,)) for req_id in inboxes))
        ref.client_impl = _OneBatch(ref, batch)
        delivery = TokenDelivery(pools, {}, inboxes.get, streams=inboxes)
        await delivery._poll(ref)
        await asyncio.gather(*readers)

    asyncio.run(main())
    return log


def test_under_many_streams_each_woken_stream_runs_before_the_next_put() -> None:
    log = _order_of_events(LOADED_FROM_STREAMS + 8)
    assert log.count("put") == log.count("took") == LOADED_FROM_STREAMS + 8
    # Put, took, put, took...: the loop turned after every stream it woke.
    assert log[:6] == ["put", "took"] * 3


def test_under_few_streams_a_batch_is_delivered_in_one_go() -> None:
    log = _order_of_events(8)
    assert log == ["put"] * 8 + ["took"] * 8


class _CachingPrefill(FakeWorker):
    """A prefill worker of a router tier (its client names a consumer) that cached one
    block since this process last heard from it; by the next poll it has left."""

    consumer = "router-1"

    def __init__(self, ref: WorkerRef) -> None:
        super().__init__(ref.worker_id)
        self._ref = ref
        self._events: tuple[KVEvents, ...] = (KVEvents(stored=(42,)),)

    async def next_kv_events(self) -> tuple[KVEvents, ...]:
        events, self._events = self._events, ()
        if not events:
            self._ref.state = WorkerState.GONE
        return events


def test_a_tier_process_learns_a_prefill_workers_cache_without_sending_it_a_prompt() -> None:
    # A session's next turn may land on another router process than its previous one:
    # that process must know which prefill worker holds the previous turn's blocks.
    async def main() -> PrefixIndex:
        pools = FakePools(1, 0)
        ref = pools.workers[PoolName.PREFILL][0]
        ref.client_impl = _CachingPrefill(ref)
        indexes = {pool: PrefixIndex(16) for pool in POOLS}
        delivery = TokenDelivery(pools, indexes, lambda _: None)
        delivery.ensure_pollers()
        await asyncio.wait_for(asyncio.gather(*delivery._pollers.values()), 1.0)
        return indexes[PoolName.PREFILL]

    assert asyncio.run(main()).num_cached_tokens(0, [42]) == 16
