"""Decode pool worker: reserves blocks, receives KV on standing receivers, decodes.

A request's life here, as named states of the reservation book:
* reserved: `reserve()` allocated its blocks under a lease; nothing is ever received
  into memory that was not reserved first;
* importing: a header for it arrived on a channel and matched the reservation (epoch,
  block ids, token count); the payload lands in a staging buffer, then in the blocks;
* running: admitted at the next step boundary, tokens flow out through `next_tokens()`;
* gone: finished, aborted, expired or refused: blocks released, exactly once.

Each prefill peer has one channel and one receiving thread. A header that does not match
a reservation is refused loudly: its payload is drained (so the channel stays in step)
and discarded, and the request ends with an error in the token stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from typing import Any

import torch

from engine.core.outputs import GenerationInput, TokenBatch, TokenUpdate
from engine.core.request import FinishReason
from engine.core.scheduler import RequestUpdate
from engine.transfer.channel import RECEIVER_RANK, ChannelClosed, ChannelSpec, KVChannel
from engine.transfer.handoff import HandoffHeader, Reservation
from engine.transfer.reservations import HeldReservation, ReservationBook
from engine.worker import WorkerBase

log = logging.getLogger(__name__)

DEFAULT_LEASE_S = 30.0
LEASE_SWEEP_S = 0.5


class DecodeWorker(WorkerBase):
    pool = "decode"

    def __init__(self, args: Any, index: int) -> None:
        super().__init__(args, index)
        self._book: ReservationBook | None = None
        self._outbox: list[TokenUpdate] = []
        self._outbox_ready = asyncio.Event()
        self._sweeper: asyncio.Task[None] | None = None

    def on_started(self) -> None:
        self._book = ReservationBook(self.epoch, self.built.layout.block_size)  # type: ignore[union-attr]
        self._sweeper = asyncio.ensure_future(self._sweep_leases())

    @property
    def book(self) -> ReservationBook:
        assert self._book is not None, "worker not started"
        return self._book

    # ---------------------------------------------------------------- reservation
    async def reserve(
        self, inp: GenerationInput, lease_s: float = DEFAULT_LEASE_S
    ) -> Reservation | None:
        """Hold blocks for the request's prompt KV; None when they don't fit now."""
        num_tokens = len(inp.prompt_token_ids)
        block_ids = await self.on_engine(lambda: self.core.reserve(inp.req_id, num_tokens))
        if block_ids is None:
            return None
        if self.is_buried(inp.req_id):  # aborted while this call was on its way
            await self.on_engine(lambda: self.core.release(inp.req_id))
            return None
        reservation = Reservation(self.worker_id, self.epoch, tuple(block_ids))
        self.book.add(inp, reservation, lease_s)
        return reservation

    async def _sweep_leases(self) -> None:
        while True:
            await asyncio.sleep(LEASE_SWEEP_S)
            for req_id in self.book.expire():
                log.warning("reservation for %s expired before its KV arrived; freeing", req_id)
                self._release(req_id)

    def _release(self, req_id: str) -> None:
        """Give a reservation's blocks back at the next step boundary (any thread)."""
        assert self.loop_thread is not None
        self.loop_thread.submit(lambda: self.core.release(req_id))

    # ---------------------------------------------------------------- receiving
    def channel_rank(self) -> int:
        return RECEIVER_RANK

    def channel_peer(self, spec: ChannelSpec) -> str:
        return spec.prefill_id

    def on_connected(self, channel: KVChannel) -> None:
        thread = threading.Thread(
            target=self._receive_loop,
            args=(channel,),
            name=f"kv-recv-{channel.spec.prefill_id}",
            daemon=True,
        )
        thread.start()

    def _receive_loop(self, channel: KVChannel) -> None:
        """Standing receiver for one prefill peer: header, payload, repeat."""
        expected_seq = 0
        while not channel.closed:
            try:
                header = channel.recv_header()
            except ChannelClosed:
                break
            except Exception as exc:  # noqa: BLE001 - the peer died or the channel broke
                if not channel.closed:
                    log.warning("channel from %s broke: %s", channel.spec.prefill_id, exc)
                break
            if header.seq_no != expected_seq:
                log.error(
                    "channel from %s out of step: header %d, expected %d; closing it",
                    channel.spec.prefill_id,
                    header.seq_no,
                    expected_seq,
                )
                break
            expected_seq += 1
            if not self._import(channel, header):
                break
        channel.close(notify_peer=False)

    def _import(self, channel: KVChannel, header: HandoffHeader) -> bool:
        """Receive one payload; False when the channel can no longer be trusted."""
        layout = self.built.layout  # type: ignore[union-attr]
        cache = self.runner.kv_cache
        block_bytes = cache[0].numel() * cache.element_size()
        num_blocks = len(header.dst_block_ids)
        if header.num_bytes != num_blocks * block_bytes:
            log.error(
                "hand-off of %s: %d bytes for %d blocks of %d bytes (layout %s); closing",
                header.req_id,
                header.num_bytes,
                num_blocks,
                block_bytes,
                layout,
            )
            self._emit_error(header.req_id, "KV hand-off refused: byte count does not match")
            return False
        held, problem = self.book.claim(header)
        staging = torch.empty(
            (num_blocks, *cache.shape[1:]), dtype=cache.dtype, device=cache.device
        )
        posted = time.perf_counter()
        try:
            # Drained even when refused (the channel stays in step); scattered into the
            # reserved blocks on the channel's stream when accepted.
            block_ids = list(header.dst_block_ids)
            scatter = None
            if held is not None:

                def scatter() -> None:
                    self.runner.scatter_blocks(block_ids, staging)

            channel.recv_into(staging, scatter)
        except Exception as exc:  # noqa: BLE001 - the peer died mid-payload
            if held is not None:
                self.book.fail(header.req_id)
                self._release(header.req_id)
                self._emit_error(header.req_id, f"KV hand-off broke off: {exc}")
            return False
        wire_s = time.perf_counter() - posted
        if held is None:
            log.warning("refused hand-off of %s: %s", header.req_id, problem)
            if not self.is_buried(header.req_id):
                self._emit_error(header.req_id, f"KV hand-off refused: {problem}")
            return True
        self._admit(held, header, wire_s)
        return True

    def _admit(self, held: HeldReservation, header: HandoffHeader, wire_s: float) -> None:
        req_id = header.req_id
        assert self.loop_thread is not None
        loop_thread = self.loop_thread

        def enqueue() -> None:
            # Engine commands run in order: any abort issued after this is applied after
            # the admission, so the request cannot slip past it.
            loop_thread.submit(
                lambda: self.core.admit_imported(held.inp, header.first_token)
            ).add_done_callback(lambda fut: self._admit_failed(req_id, fut.exception()))

        if self.book.complete(req_id, enqueue):
            self._post(TokenUpdate(req_id, kv_wire_s=wire_s))
        else:  # aborted while its bytes were on the wire
            self._release(req_id)

    def _admit_failed(self, req_id: str, exc: BaseException | None) -> None:
        # Engine thread. Never expected; if it happens, free the blocks and tell the router.
        if exc is None:
            return
        log.error("admitting %s after its hand-off failed: %r", req_id, exc)
        self.core.release(req_id)
        self._emit_error(req_id, f"admitting the request failed: {exc}")

    def _emit_error(self, req_id: str, error: str) -> None:
        self._post(TokenUpdate(req_id, finish_reason=FinishReason.ERROR, error=error))

    def _post(self, update: TokenUpdate) -> None:
        """Queue an update from any thread."""
        self._loop.call_soon_threadsafe(self._append, [update])

    def _append(self, updates: list[TokenUpdate]) -> None:
        self._outbox.extend(updates)
        self._outbox_ready.set()

    # ---------------------------------------------------------------- tokens out
    def on_updates(self, updates: list[RequestUpdate]) -> None:
        self._append(
            [
                TokenUpdate(u.req_id, u.new_token_ids, u.finish_reason, u.num_cached_tokens)
                for u in updates
            ]
        )

    async def next_tokens(self, wait_s: float = 1.0) -> TokenBatch:
        """Long-poll: every update produced since the last call (empty after wait_s)."""
        if not self._outbox:
            self._outbox_ready.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._outbox_ready.wait(), wait_s)
        out, self._outbox = self._outbox, []
        return TokenBatch(tuple(out), self.take_kv_events())

    async def submit(self, inp: GenerationInput) -> None:
        """Run a request's prompt here too (no hand-off: short or cached prompts, and
        colocated replicas); its tokens arrive through next_tokens()."""
        if self.is_buried(inp.req_id):
            return  # aborted before it got here
        # The router validated the prompt already.
        await self.on_engine(lambda: self.core.add_request(inp, validate=False))

    # ---------------------------------------------------------------- abort
    async def abort(self, req_id: str) -> None:
        """Idempotent, any state: reserved → released; importing → discarded on arrival;
        running → finished and freed at the next step boundary."""
        self.bury(req_id)
        if self._book is not None and self.book.abort(req_id):
            await self.on_engine(lambda: self.core.release(req_id))
            return
        await self.on_engine(lambda: self.core.abort(req_id))

    async def shutdown(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        await super().shutdown()
