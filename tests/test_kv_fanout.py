"""Prefix-cache events for every router process: each takes its own copy, a new one
starts from a snapshot, and a list nobody reads stays bounded."""

from __future__ import annotations

import asyncio

from engine.core.kv_events import KVEvents
from engine.worker.kv_fanout import MAX_PENDING_BATCHES, KVEventFanout, fold


def test_fold_gives_the_net_effect_of_the_batches_in_order() -> None:
    batches = [KVEvents(stored=(1, 2)), KVEvents(removed=(1,)), KVEvents(stored=(3,))]
    assert fold(batches) == KVEvents(stored=(2, 3), removed=(1,))
    with_snapshot = [
        KVEvents(stored=(9,)),
        KVEvents(stored=(1, 2), full=True),
        KVEvents(removed=(2,)),
    ]
    assert fold(with_snapshot) == KVEvents(stored=(1,), full=True)


def test_every_consumer_gets_every_event_and_a_new_one_starts_from_a_snapshot() -> None:
    asked: list[str] = []
    fanout = KVEventFanout(asked.append)
    fanout.add(KVEvents(stored=(1,), full=True))
    assert fanout.take("r1") == ()  # new: a snapshot is asked for
    assert asked == ["r1"]
    fanout.add(KVEvents(stored=(2,)))  # a step's events before the snapshot is read...
    fanout.set_snapshot("r1", KVEvents(stored=(1, 2), full=True))  # ... which covers them
    fanout.add(KVEvents(stored=(3,)))
    assert fanout.take("r1") == (KVEvents(stored=(1, 2), full=True), KVEvents(stored=(3,)))
    assert fanout.take("") == (
        KVEvents(stored=(1,), full=True),
        KVEvents(stored=(2,)),
        KVEvents(stored=(3,)),
    )
    assert fanout.take("") == ()


def test_a_consumer_that_never_reads_holds_one_folded_batch() -> None:
    fanout = KVEventFanout()
    for i in range(3 * MAX_PENDING_BATCHES):
        fanout.add(KVEvents(stored=(i,)))
    taken = fanout.take("")
    assert len(taken) <= MAX_PENDING_BATCHES
    assert set(fold(list(taken)).stored) == set(range(3 * MAX_PENDING_BATCHES))


def test_a_waiting_consumer_gets_its_events_as_they_come_and_nothing_after_its_wait() -> None:
    async def main() -> None:
        fanout = KVEventFanout()
        assert await fanout.wait("r1", 0.01) == ()  # new: nothing yet, none after the wait
        waiting = asyncio.ensure_future(fanout.wait("r1", 5.0))
        await asyncio.sleep(0)
        assert not waiting.done()
        fanout.add(KVEvents(stored=(1,)))
        assert await asyncio.wait_for(waiting, 1.0) == (KVEvents(stored=(1,)),)

    asyncio.run(main())
