"""A decode worker's side of a router tier: a client's request found by its id, handed
over to another router process (a resumed stream), kept for a while when its router
process lets it go or goes away (decode_worker/outboxes.py keeps the books)."""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import TYPE_CHECKING, Any

from decode_worker.outboxes import Outboxes
from engine.wire import Handover

log = logging.getLogger(__name__)


class RouterHandover:
    """`DecodeWorker`'s verbs for router processes: `locate`, `adopt`, `let_go`; and the
    sweep that notices a router process gone."""

    outboxes: Outboxes

    if TYPE_CHECKING:  # provided by WorkerBase and DecodeWorker
        _loop: asyncio.AbstractEventLoop
        loop_thread: Any
        kv_fanout: Any

        @property
        def core(self) -> Any: ...

        @property
        def book(self) -> Any: ...

        async def on_engine(self, fn: Any) -> Any: ...

        async def abort(self, req_id: str, consumer: str = "") -> None: ...

    async def locate(self, request_id: str) -> str | None:
        """The id under which the client's request `request_id` runs here, if it does
        (a router process re-attaching a stream; a router tier's requests only)."""
        return self.outboxes.locate(request_id)

    async def adopt(self, req_id: str, consumer: str = "") -> Handover | None:
        """Hand the request to router process `consumer`: its tokens so far, and from
        now on its updates in that consumer's outbox. None when it is not here (ended,
        aborted, or never here)."""
        if self.outboxes.consumer_of(req_id) is None:
            return None
        handover = self.outboxes.handover_now(req_id, consumer)
        if handover is not None:
            return handover
        # Read its tokens at a step boundary and switch it there, in order with the
        # steps' updates (those before the read stay behind, those after go to it).
        loop = self._loop
        done: asyncio.Future[Handover | None] = loop.create_future()

        def switch(outputs: tuple[int, ...] | None, kv_pending: bool) -> None:
            if not done.done():
                done.set_result(
                    self.outboxes.handover_at_boundary(req_id, consumer, outputs, kv_pending)
                )

        def read() -> None:
            outputs = self._outputs_of(req_id)
            kv_pending = outputs is None and self.book.holds(req_id)
            loop.call_soon_threadsafe(switch, outputs, kv_pending)

        await self.on_engine(read)
        return await done

    async def let_go(self, req_id: str, consumer: str = "", keep_s: float = 0.0) -> bool:
        """The router process `consumer` no longer streams the request (its client's
        stream broke): keep it decoding for `keep_s`, for a resumed stream to take over
        (`adopt`), then abort it. False when it is not that consumer's here."""
        if self.outboxes.consumer_of(req_id) != consumer or self.loop_thread is None:
            return False
        self.loop_thread.submit(functools.partial(self._record_orphans, [req_id], keep_s))
        return True

    def _outputs_of(self, req_id: str) -> tuple[int, ...] | None:
        """Engine thread: the tokens the request produced so far (None: not on the
        engine), as far as the updates already posted for it go."""
        req = self.core.scheduler.requests.get(req_id)
        if req is None:
            return None
        tokens = req.all_token_ids
        end = len(tokens)
        while end > req.num_prompt_tokens and tokens[end - 1] < 0:
            end -= 1  # a step in flight's placeholder: its token is not out yet
        return tuple(tokens[req.num_prompt_tokens : end])

    def _record_orphans(self, req_ids: list[str], keep_s: float | None = None) -> None:
        """Engine thread: the tokens so far of requests nobody reads (a gone router
        process's, or let go of), recorded on the event loop behind the updates already
        posted."""
        outputs = {r: self._outputs_of(r) for r in req_ids}
        self._loop.call_soon_threadsafe(self.outboxes.start_orphans, outputs, keep_s)

    def _sweep_consumers(self) -> None:
        """Router processes that went away: their requests' tokens are recorded for a
        take-over; those whose grace is over are aborted here."""
        lost, expired = self.outboxes.sweep()
        for consumer in lost:
            mine = self.outboxes.requests_of(consumer)
            if mine:
                log.warning(
                    "router process %s stopped polling; keeping its %d requests for "
                    "another to take over",
                    consumer,
                    len(mine),
                )
            if mine and self.loop_thread is not None:
                self.loop_thread.submit(functools.partial(self._record_orphans, mine))
            self.kv_fanout.forget(consumer)
        if expired:
            log.warning("aborting %d requests nobody took over", len(expired))
        for req_id in expired:
            asyncio.ensure_future(self.abort(req_id))
