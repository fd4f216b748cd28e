"""One request's inbox of decode-worker news, merged when its reader falls behind.

At high concurrency the router's single event loop, not the decode GPU, sets the pace
of delivery: every update costs a detokenize call and a gRPC message. When a request's
stream handler wakes up to several updates, it takes them as one (all their tokens, one
chunk, one message), so the per-token cost shrinks exactly when the loop is busiest and
no token waits for a message of its own. Failures are never merged across: tokens that
came before a failure are handed out first, then the failure.

A plain deque and at most one waiting future: a put costs an append (and a wake-up when
the stream sleeps), a take with items ready costs no scheduling at all.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass

from engine.core.request import FinishReason
from engine.wire import TokenUpdate, merge_updates


@dataclass(frozen=True)
class Moved:
    """The request moved, KV and all, to another decode worker (router/live_migration.py):
    `outputs` are every token its previous attempt produced, the first of them the
    client's token number `first_index`; what the client has not seen of them yet is
    streamed from here, then the new attempt's tokens follow."""

    outputs: tuple[int, ...]
    first_index: int


Item = TokenUpdate | BaseException | Moved


def _is_failure(item: Item) -> bool:
    """Items never merged with others: failures, and the point where the request moved."""
    return not isinstance(item, TokenUpdate) or item.finish_reason is FinishReason.ERROR


class UpdateInbox:
    """put() from the poller (never blocks); take() from the request's stream."""

    def __init__(self) -> None:
        self._ready: deque[Item] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: Item) -> None:
        self._ready.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self, timeout_s: float | None) -> Item:
        """Everything that has arrived, merged; waits up to timeout_s for the first item
        (TimeoutError after)."""
        while not self._ready:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                async with asyncio.timeout(timeout_s):
                    await self._waiter
            finally:
                self._waiter = None
        first = self._ready.popleft()
        if _is_failure(first):
            return first
        assert isinstance(first, TokenUpdate)
        taken = [first]
        while self._ready and not _is_failure(self._ready[0]) and taken[-1].finish_reason is None:
            taken.append(self._ready.popleft())  # type: ignore[arg-type]
        return merge_updates(taken)
