"""A worker's prefix-cache events for every router process that reads them.

Each router process keeps its own index of every worker's prefix cache
(router/routing/kv_index.py), fed by the events the worker's replies carry: a prefill
reply, a token batch. With several router processes (a router tier), each of them is a
*consumer* here, named by the id its calls carry, and gets every event: a step's events
are appended to every consumer's list and each consumer's next message takes its own.
The first events a consumer new to this worker gets are a snapshot of the whole cache
(`KVEvents.full`), taken on the engine thread; a consumer unheard of for
`FORGET_AFTER_S` is forgotten (its next message starts with a snapshot again). A list
nobody takes for a while is folded into one batch, so its size is bounded by the
cache's, not by the time since it was last read.

The unnamed consumer "" is the one router process of a service without a tier: it is
never forgotten, and its first events are the engine's own first batch (a snapshot).

A consumer may also wait for its events (`wait`): a router process of a tier long-polls
every prefill worker so, since a prefill worker's events otherwise come only with the
replies to that process's own prompts, and a session's next turn that lands on another
process must still find the worker that holds its previous turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from engine.core.kv_events import KVEvents

# Batches kept for one consumer before they are folded into one.
MAX_PENDING_BATCHES = 64
# A named consumer that has taken nothing for this long is gone (a router process that
# exited); one that comes back is new again.
FORGET_AFTER_S = 120.0


def fold(batches: list[KVEvents]) -> KVEvents:
    """Several batches, in order, as one with the same effect."""
    present: dict[int, bool] = {}
    full = False
    for events in batches:
        if events.full:
            present = dict.fromkeys(events.stored, True)
            full = True
            continue
        for block_hash in events.removed:
            present[block_hash] = False
        for block_hash in events.stored:
            present[block_hash] = True
    stored = tuple(h for h, held in present.items() if held)
    if full:
        return KVEvents(stored=stored, full=True)
    return KVEvents(stored=stored, removed=tuple(h for h, held in present.items() if not held))


class KVEventFanout:
    """Per consumer, the prefix-cache events it has not taken yet (event loop only)."""

    def __init__(
        self,
        request_snapshot: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # Asked to deliver a snapshot to a consumer seen for the first time (set_snapshot).
        self._request_snapshot = request_snapshot
        self._clock = clock
        self._pending: dict[str, list[KVEvents]] = {"": []}
        self._seen: dict[str, float] = {}
        self._changed = asyncio.Event()  # set on every change; each waiter re-checks its own

    @property
    def consumers(self) -> frozenset[str]:
        return frozenset(self._pending)

    def add(self, events: KVEvents) -> None:
        """One step's changes, for every consumer."""
        if events.is_empty:
            return
        for consumer, batches in self._pending.items():
            batches.append(events)
            if len(batches) > MAX_PENDING_BATCHES:
                self._pending[consumer] = [fold(batches)]
        self._wake()

    def take(self, consumer: str = "") -> tuple[KVEvents, ...]:
        """The consumer's events since its last take, oldest first."""
        if consumer not in self._pending:
            self.touch(consumer)
            return ()
        if consumer:
            now = self._seen[consumer] = self._clock()
            self._forget_stale(now)
        batches = self._pending.get(consumer)
        if not batches:
            return ()
        self._pending[consumer] = []
        return tuple(batches)

    async def wait(self, consumer: str, wait_s: float) -> tuple[KVEvents, ...]:
        """`take(consumer)` once it has events, or empty after `wait_s`."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait_s):
                while not (events := self.take(consumer)):
                    await self._changed.wait()
                return events
        return ()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()  # the waiters woken hold the old one

    def touch(self, consumer: str) -> None:
        """The consumer is about (a call of its arrived): a new one gets a snapshot."""
        if not consumer:
            return
        now = self._clock()
        self._seen[consumer] = now
        if consumer not in self._pending:
            self._pending[consumer] = []
            if self._request_snapshot is not None:
                self._request_snapshot(consumer)
        self._forget_stale(now)

    def set_snapshot(self, consumer: str, snapshot: KVEvents) -> None:
        """A snapshot of the cache for `consumer`, in place of whatever it had pending:
        called in order with the steps' events (right after those the snapshot covers)."""
        if consumer in self._pending:
            self._pending[consumer] = [snapshot]
            self._wake()

    def forget(self, consumer: str) -> None:
        if consumer:
            self._pending.pop(consumer, None)
            self._seen.pop(consumer, None)

    def _forget_stale(self, now: float) -> None:
        for consumer, seen in list(self._seen.items()):
            if now - seen > FORGET_AFTER_S:
                self.forget(consumer)
