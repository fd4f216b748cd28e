"""The token poller under many streams: a batch's woken streams run between its puts, so
the event loop turns often enough to take in new calls; under few, it delivers at once."""

from __future__ import annotations

import asyncio
from typing import Any

from bench.fake_workers import FakePools
from engine.wire import PoolName, TokenBatch, TokenUpdate
from router.fleet.worker_state import WorkerState
from router.routing.worker_load import WorkerLoad
from router.serving.delivery import LOADED_FROM_STREAMS, TokenDelivery
from router.serving.inbox import UpdateInbox


class _Client:
    def __init__(self, ref: _Ref, batch: TokenBatch) -> None:
        self._ref, self._batch = ref, batch

    async def next_tokens(self) -> TokenBatch:
        batch, self._batch = self._batch, TokenBatch(())
        if not batch.updates:
            self._ref.state = WorkerState.GONE  # the second poll: the worker left, the poller ends
        return batch


class _Ref:
    pool, index = PoolName.DECODE, 0

    def __init__(self, batch: TokenBatch) -> None:
        self.state = WorkerState.LIVE
        self.load = WorkerLoad()
        self.client = _Client(self, batch)


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
        ref = _Ref(TokenBatch(tuple(TokenUpdate(req_id, (7,)) for req_id in inboxes)))
        delivery = TokenDelivery(FakePools(0, 0), {}, inboxes.get, streams=inboxes)
        await delivery._poll(ref)  # type: ignore[arg-type]
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
