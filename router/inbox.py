"""One request's inbox of decode-worker news, merged when its reader falls behind.

At high concurrency the router's single event loop, not the decode GPU, sets the pace
of delivery: every update costs a detokenize call and a gRPC message. When a request's
stream handler wakes up to several updates, it takes them as one (all their tokens, one
chunk, one message), so the per-token cost shrinks exactly when the loop is busiest and
no token waits for a message of its own. Failures are never merged across: tokens that
came before a failure are handed out first, then the failure.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import replace

from engine.core.outputs import TokenUpdate
from engine.core.request import FinishReason

Item = TokenUpdate | BaseException


def _is_failure(item: Item) -> bool:
    return isinstance(item, BaseException) or item.finish_reason is FinishReason.ERROR


class UpdateInbox:
    """put() from the poller (never blocks); take() from the request's stream."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[Item] = asyncio.Queue()
        self._ready: deque[Item] = deque()  # drained from the queue, not yet handed out

    def put(self, item: Item) -> None:
        self._queue.put_nowait(item)

    async def take(self, timeout_s: float | None) -> Item:
        """Everything that has arrived, merged; waits up to timeout_s for the first item
        (TimeoutError after)."""
        if not self._ready:
            self._ready.append(await asyncio.wait_for(self._queue.get(), timeout_s))
        while not self._queue.empty():
            self._ready.append(self._queue.get_nowait())
        first = self._ready.popleft()
        if _is_failure(first):
            return first
        assert isinstance(first, TokenUpdate)
        taken = [first]
        while self._ready and not _is_failure(self._ready[0]) and taken[-1].finish_reason is None:
            taken.append(self._ready.popleft())  # type: ignore[arg-type]
        if len(taken) == 1:
            return first
        return replace(
            first,
            new_token_ids=tuple(t for u in taken for t in u.new_token_ids),
            finish_reason=taken[-1].finish_reason,
            num_cached_tokens=max(u.num_cached_tokens for u in taken),
            kv_wire_s=next((u.kv_wire_s for u in reversed(taken) if u.kv_wire_s), 0.0),
            kv_handoff_s=next((u.kv_handoff_s for u in reversed(taken) if u.kv_handoff_s), 0.0),
        )
