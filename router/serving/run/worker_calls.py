"""Calls to workers on a request's behalf, where a failed call is news for the pools.

A call that finds its worker dead (`WorkerDied`) tells the pools, which replace it, and
loses the attempt that made it (`WorkerLost`: the request goes on in a new attempt).
Aborts go out in the background (an attempt may end while its stream is being closed)
and never fail: a worker that is gone took the request with it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar

from router.fleet.clients import WorkerDied
from router.serving.run.attempts import WorkerLost
from router.serving.workers import Pools, WorkerRef

T = TypeVar("T")


class WorkerCalls:
    """Worker calls for the serving core, and the background tasks they leave."""

    def __init__(self, pools: Pools) -> None:
        self.pools = pools
        self._background: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run `coro` in the background (kept referenced until it is done)."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def died(self, ref: WorkerRef, exc: WorkerDied) -> str:
        """A call to `ref` found it dead: the pools hear of it. The reason, as logged."""
        reason = f"{ref.worker_id} died: {exc}"
        self.pools.mark_dead(ref, reason)
        return reason

    async def call(self, ref: WorkerRef, pending: Awaitable[T]) -> T:
        """A worker call whose failure means the worker died: mark it, lose the attempt."""
        try:
            return await pending
        except WorkerDied as exc:
            raise WorkerLost(self.died(ref, exc), worker=ref) from exc

    def abort(self, ref: WorkerRef, req_id: str) -> None:
        """Abort `req_id` on `ref`, in the background (idempotent there)."""
        self.spawn(self._abort(ref, req_id))

    async def _abort(self, ref: WorkerRef, req_id: str) -> None:
        if ref.state.ended:
            return
        try:
            await ref.client.abort(req_id)
        except WorkerDied as exc:
            self.died(ref, exc)
