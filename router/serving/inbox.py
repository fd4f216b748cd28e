"""One request's inbox of decode-worker news, merged when its reader falls behind.

At high concurrency the router's single event loop, not the decode GPU, sets the pace
of delivery: every update costs a detokenize call and a gRPC message. When a request's
stream handler wakes up to several updates, it takes them as one (all their tokens, one
chunk, one message), so the per-token cost shrinks exactly when the loop is busiest and
no token waits for a message of its own. Failures are never merged across: tokens that
came before a failure are handed out first, then the failure.

A plain deque and at most one waiting future: a put costs an append (and a wake-up when
the stream sleeps), a take with items ready costs no scheduling at all. A take may ask
for at least N tokens (`--stream-interval N`): puts below that do not wake the stream, so
its whole chain (detokenize, generators, gRPC write) runs once per N tokens rather than
once per decode step. A finish, a failure or a move wakes it at once.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass

from engine.core.request import FinishReason
from engine.wire import TokenUpdate, merge_updates


@dataclass(frozen=True)
class Moved:
    """The request moved, KV and all, to another decode worker (router/serving/live_migration.py):
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
        self._num_tokens = 0  # tokens in the plain updates ready (no finish, no failure)
        self._urgent = False  # something ready that ends the wait whatever the count
        self._wake_at = 1  # tokens that wake a waiting take

    def put(self, item: Item) -> bool:
        """Queue an item; True when it woke the stream waiting on it."""
        self._ready.append(item)
        if isinstance(item, TokenUpdate) and item.finish_reason is None:
            self._num_tokens += len(item.new_token_ids)
            if self._num_tokens < self._wake_at:
                return False
        else:
            self._urgent = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
            return True
        return False

    async def take(self, timeout_s: float | None, min_tokens: int = 1) -> Item:
        """Everything that has arrived, merged. Waits until at least `min_tokens` tokens,
        a finish, a failure or a move have arrived; after timeout_s without one, returns
        what has arrived, or raises TimeoutError if nothing has."""
        while not self._ready or (not self._urgent and self._num_tokens < min_tokens):
            self._wake_at = min_tokens
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                async with asyncio.timeout(timeout_s):
                    await self._waiter
            except TimeoutError:
                if not self._ready:
                    raise
                break
            finally:
                self._waiter = None
                self._wake_at = 1
        first = self._ready.popleft()
        if _is_failure(first):
            taken: Item = first
        else:
            assert isinstance(first, TokenUpdate)
            run = [first]
            while self._ready and not _is_failure(self._ready[0]) and run[-1].finish_reason is None:
                run.append(self._ready.popleft())  # type: ignore[arg-type]
            taken = merge_updates(run)
        # What is left (a failure behind the tokens just taken, rarely more) is counted
        # again for the next take.
        self._num_tokens, self._urgent = 0, False
        for item in self._ready:
            if isinstance(item, TokenUpdate) and item.finish_reason is None:
                self._num_tokens += len(item.new_token_ids)
            else:
                self._urgent = True
        return taken
