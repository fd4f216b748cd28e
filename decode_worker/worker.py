"""Decode pool worker: reserves blocks, receives KV on standing receivers (one channel
and one receiving thread a sending peer), decodes.

A request's life here, as named states of the reservation book
(`engine/transfer/receiver.py` walks them): reserved (blocks allocated under a lease the
router renews while the request is queued or prefilling) → importing (its header matched)
→ running (admitted at a step boundary; tokens flow out through `next_tokens()`) → gone
(finished, aborted, expired or refused: blocks released, exactly once). A reservation
made for KV from one sender fails at once when that sender's channel breaks, so its
request is re-run instead of waiting out the lease. A router tier's side is
decode_worker/handover.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from decode_worker.export import KVExporter
from decode_worker.handover import RouterHandover
from decode_worker.outboxes import Outboxes
from engine.core.request import FinishReason
from engine.core.role import EngineRole
from engine.model.staging import to_device
from engine.transfer.base import PairChannel
from engine.transfer.channel import RECEIVER_RANK
from engine.transfer.import_target import KVArrival
from engine.transfer.receiver import ChannelReceiver
from engine.transfer.reservations import AbortOutcome, ReservationBook
from engine.wire import (
    ChannelSpec,
    DetachedRequest,
    GenerationInput,
    Reservation,
    TokenBatch,
    TokenUpdate,
    coalesce,
)
from engine.worker.actor import WorkerBase
from engine.worker.contract import DecodeCalls
from engine.worker.phases import Waiting, arrival_phases, decode_start_phases, prompt_phases

log = logging.getLogger(__name__)

DEFAULT_LEASE_S = 30.0
LEASE_SWEEP_S = 0.5


class DecodeWorker(KVExporter, RouterHandover, WorkerBase):
    pool = "decode"
    role = EngineRole.DECODE
    contract: ClassVar[type] = DecodeCalls

    def __init__(
        self, args: Any, index: int, tracing_config: Any = None, tp_group: Any = None
    ) -> None:
        super().__init__(args, index, tracing_config, tp_group)
        self._book: ReservationBook | None = None
        # Requests with no token out yet (a prompt submitted, or KV landed): their first
        # token closes their phases here (worker_phases). Written from the receiving
        # threads too: one dict operation at a time.
        self._starting: dict[str, Waiting] = {}
        # Updates per router process (one, "", without a router tier).
        self.outboxes = Outboxes()
        self._sweeper: asyncio.Task[None] | None = None
        self._sources: dict[str, str] = {}  # req_id → the peer its KV comes from
        self.send_channels: dict[str, PairChannel] = {}  # to peer decode workers (export.py)

    def on_started(self) -> None:
        self._book = ReservationBook(self.epoch, self.built.layout.block_size)  # type: ignore[union-attr]
        self._sweeper = asyncio.ensure_future(self._sweep_leases())

    @property
    def book(self) -> ReservationBook:
        assert self._book is not None, "worker not started"
        return self._book

    # ---------------------------------------------------------------- reservation
    async def reserve(
        self, inp: GenerationInput, lease_s: float = DEFAULT_LEASE_S, source: str | None = None
    ) -> Reservation | None:
        """Hold blocks for the request's prompt KV; None when they don't fit now.
        `source` names the sender, if known: its channel breaking fails the request.
        Blocks a live move's pre-copy brought for this id are adopted, first, and the
        reservation says how many (`num_precopied`): the sender skips them."""
        return (await self.reserve_many([inp], lease_s, source))[0]

    async def reserve_many(
        self,
        inps: Sequence[GenerationInput],
        lease_s: float = DEFAULT_LEASE_S,
        source: str | None = None,
    ) -> list[Reservation | None]:
        """`reserve` for several requests from one sender in one engine command (a live
        move's requests: each waits for the slowest, so they should not queue behind one
        another's calls)."""
        precopied = [self.book.precopied(inp.req_id) for inp in inps]

        def hold_all() -> tuple[list[list[int] | None], Any]:
            held = []
            for inp, num_precopied in zip(inps, precopied, strict=True):
                # A pre-copy's blocks stay first and the rest are added to them.
                hold = self.core.reserve if num_precopied is None else self.core.resize_reservation
                held.append(hold(inp.req_id, len(inp.prompt_token_ids)))
            # The engine's last launched step, read with the blocks handed out: the import
            # waits for it alone (a later step never writes them; see HeldReservation).
            return held, self.runner.last_step_done

        held, writable_after = await self.on_engine(hold_all)
        reservations: list[Reservation | None] = []
        for inp, num_precopied, block_ids in zip(inps, precopied, held, strict=True):
            reservations.append(
                await self._book_reservation(
                    inp, num_precopied, block_ids, writable_after, lease_s, source
                )
            )
        return reservations

    async def _book_reservation(
        self,
        inp: GenerationInput,
        num_precopied: int | None,
        block_ids: list[int] | None,
        writable_after: Any,
        lease_s: float,
        source: str | None,
    ) -> Reservation | None:
        if block_ids is None or len(block_ids) < (num_precopied or 0):
            return None  # no room (a pre-copy left is aborted by the router, or expires)
        if self.is_buried(inp.req_id):  # aborted while this call was on its way
            await self.on_engine(lambda: self.core.release(inp.req_id))
            return None
        reservation = Reservation(self.worker_id, self.epoch, tuple(block_ids), num_precopied or 0)
        if num_precopied is None:
            self.book.add(inp, reservation, lease_s, writable_after)
        elif not self.book.adopt(inp, reservation, lease_s, writable_after):
            return None  # aborted or expired meanwhile: its blocks went with it
        self.outboxes.assign(inp)
        if source is not None:
            self._sources[inp.req_id] = source
        return reservation

    def reserve_precopy(
        self, requests: list[tuple[str, int]]
    ) -> list[tuple[Reservation, Any] | None]:
        assert self.loop_thread is not None

        def reserve_all() -> tuple[list[list[int] | None], Any]:
            blocks = []
            for req_id, num_tokens in requests:
                try:
                    blocks.append(self.core.reserve(req_id, num_tokens))
                except ValueError:  # the id holds blocks here already
                    blocks.append(None)
            return blocks, self.runner.last_step_done

        blocks, writable_after = self.loop_thread.submit(reserve_all).result()
        return [
            None
            if ids is None
            else (Reservation(self.worker_id, self.epoch, tuple(ids)), writable_after)
            for ids in blocks
        ]

    async def renew(self, req_ids: list[str], lease_s: float = DEFAULT_LEASE_S) -> int:
        """Extend the leases of reservations whose requests still make progress
        elsewhere (queued or prefilling); returns how many are still held."""
        return self.book.renew(req_ids, lease_s)

    async def _sweep_leases(self) -> None:
        while True:
            await asyncio.sleep(LEASE_SWEEP_S)
            for req_id in self.book.expire():
                log.warning("reservation for %s expired before its KV arrived; freeing", req_id)
                self.release(req_id)
                self.fail(req_id, "KV hand-off refused: the reservation expired")
            for req_id in self.book.expire_precopies():  # no request waits on these
                log.info("pre-copy for %s not adopted; freeing its blocks", req_id)
                self.release(req_id)
            self._sweep_consumers()

    # ---------------------------------------------------------------- ImportTarget
    @property
    def num_layers(self) -> int:
        return int(self.runner.kv_cache.shape[1])

    def staging(
        self, num_blocks: int, layers: tuple[int, int], num_heads: int | None = None
    ) -> torch.Tensor:
        """`num_heads`: a buffer for only that many of this rank's KV heads (a part)."""
        cache = self.runner.kv_cache
        heads = cache.shape[4] if num_heads is None else num_heads
        shape = (num_blocks, layers[1] - layers[0], *cache.shape[2:4], heads, cache.shape[5])
        return torch.empty(shape, dtype=cache.dtype, device=cache.device)

    def scatter(
        self,
        block_ids: list[int],
        rows: torch.Tensor,
        row_ids: list[int] | None,
        layers: tuple[int, int],
        after: list[Any],
        heads: tuple[int, int] | None = None,
    ) -> None:
        """`heads`: only these of this rank's KV heads (a tensor-parallel part)."""
        if row_ids is not None:
            rows = rows.index_select(0, to_device(row_ids, torch.long, rows.device))
        self.runner.scatter_blocks(block_ids, rows, layers, after=after, heads=heads)

    def admit(self, inp: GenerationInput, first_token: int) -> None:
        # Engine commands run in order: any abort issued after this is applied after
        # the admission, so the request cannot slip past it.
        assert self.loop_thread is not None
        req_id = inp.req_id
        self._sources.pop(req_id, None)
        if inp.consumer:
            # Handed over (or orphaned) before its KV landed: the first token, which the
            # prefill reply carried to the router process that is gone, is its first news.
            self._loop.call_soon_threadsafe(self.outboxes.first_token, req_id, first_token)
        self.loop_thread.submit(
            lambda: self.core.admit_imported(inp, first_token)
        ).add_done_callback(lambda fut: self._admit_failed(req_id, fut.exception()))

    def arrived(self, arrival: KVArrival) -> None:
        req_id = arrival.inp.req_id
        self._starting[req_id] = Waiting(arrival.inp, arrival.received_at, imported=True)
        phases = arrival_phases(self.worker_id, arrival)
        self._post(
            TokenUpdate(
                req_id, kv_wire_s=arrival.wire_s, kv_handoff_s=arrival.handoff_s, phases=phases
            )
        )

    def release(self, req_id: str) -> None:
        """Give a reservation's blocks back at the next step boundary (any thread)."""
        assert self.loop_thread is not None
        self._sources.pop(req_id, None)
        self.loop_thread.submit(lambda: self.core.release(req_id))

    def fail(self, req_id: str, error: str) -> None:
        self._starting.pop(req_id, None)
        self._post(TokenUpdate(req_id, finish_reason=FinishReason.ERROR, error=error))

    def _admit_failed(self, req_id: str, exc: BaseException | None) -> None:
        # Engine thread. Never expected; if it happens, free the blocks and tell the router.
        if exc is None:
            return
        log.error("admitting %s after its hand-off failed: %r", req_id, exc)
        self.core.release(req_id)
        self.fail(req_id, f"admitting the request failed: {exc}")

    # ---------------------------------------------------------------- receiving
    def channel_rank(self) -> int:
        return RECEIVER_RANK

    def channel_peer(self, spec: ChannelSpec) -> str:
        return spec.sender_id

    async def connect(self, spec: ChannelSpec) -> None:
        """Build this end of a pair's channel: the receiving end (from a prefill worker,
        or from a decode worker that hands requests over), or, when the spec names this
        worker as the sender, the sending end to a peer decode worker."""
        if spec.sender_id == self.worker_id:
            await self.connect_sender(spec)
        else:
            await super().connect(spec)

    async def disconnect(self, peer_id: str, notify_peer: bool = True) -> None:
        await self.disconnect_sender(peer_id, notify_peer)
        await super().disconnect(peer_id, notify_peer)

    def on_connected(self, channel: PairChannel) -> None:
        thread = threading.Thread(
            target=self._receive,
            args=(channel,),
            name=f"kv-recv-{channel.peer_id}",
            daemon=True,
        )
        thread.start()

    def _receive(self, channel: PairChannel) -> None:
        target, mirror = self.import_target(channel)
        ChannelReceiver(channel, self.book, target, mirror=mirror).run()
        # The sender is gone: reservations waiting for its KV will never be filled.
        self._loop.call_soon_threadsafe(self._fail_waiting_on, channel.peer_id)

    def _fail_waiting_on(self, peer_id: str) -> None:
        for req_id, source in list(self._sources.items()):
            if source == peer_id and self.book.abort(req_id) is AbortOutcome.DROPPED:
                self.release(req_id)
                self.fail(req_id, f"KV hand-off refused: the channel from {peer_id} closed")

    def _post(self, update: TokenUpdate) -> None:
        """Queue an update from any thread."""
        self._loop.call_soon_threadsafe(self.outboxes.route, [update])

    # ---------------------------------------------------------------- tokens out
    def on_updates(self, updates: list[TokenUpdate], stepped_at: float) -> None:
        starting = self._starting
        if starting:  # some request's first token may be here: its phases with it
            # A few requests start among a batch's many (the list is this loop's now).
            for i, u in enumerate(updates):
                if u.req_id in starting:
                    updates[i] = self._with_phases(u, stepped_at)
        self.outboxes.route(updates)  # the engine's own updates are what the router reads

    def _with_phases(self, u: TokenUpdate, stepped_at: float) -> TokenUpdate:
        """The update, carrying the request's phases here if this is its first token."""
        waiting = self._starting.pop(u.req_id, None)
        if waiting is None:
            return u
        if waiting.imported:
            phases = decode_start_phases(self.worker_id, waiting, u, stepped_at)
        else:
            phases = prompt_phases(
                self.pool, self.worker_id, waiting.inp, waiting.since, u, stepped_at
            )
        return u._replace(phases=phases)

    async def next_tokens(
        self, wait_s: float = 1.0, consumer: str = "", grace_s: float | None = None
    ) -> TokenBatch:
        """Long-poll: every update of `consumer`'s requests produced since its last call
        (empty after wait_s). `grace_s`: how long its requests are kept for another
        router process to take over, should it go away."""
        box = self.outboxes.poll_started(consumer, grace_s)
        try:
            if not box.updates:
                box.ready.clear()
                # A timeout scope, not `wait_for`: no task of its own for every poll.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait_s):
                        await box.ready.wait()
            out = self.outboxes.take(box)
        finally:
            self.outboxes.poll_ended(box)
        # Steps that piled up since the last poll travel as one update per request.
        return TokenBatch(tuple(coalesce(out)), self.take_kv_events(consumer), self.latest_stats())

    async def submit(self, inp: GenerationInput) -> None:
        """Run a request's prompt here too (no hand-off: short or cached prompts, a
        prefill pool that is saturated or down, and colocated replicas); its tokens
        arrive through next_tokens()."""
        if self.is_buried(inp.req_id):
            return  # aborted before it got here
        self.outboxes.assign(inp)
        self._starting[inp.req_id] = Waiting(inp, time.monotonic(), imported=False)
        # The router validated the prompt already.
        await self.on_engine(lambda: self.core.add_request(inp, validate=False))

    async def detach(self, req_ids: Sequence[str]) -> list[DetachedRequest | None]:
        detached = await super().detach(req_ids)
        for req_id, moved in zip(req_ids, detached, strict=True):
            if moved is not None:
                self.outboxes.forget(req_id)  # it goes on elsewhere, under a new id
        return detached

    # ---------------------------------------------------------------- abort
    async def abort(self, req_id: str, consumer: str = "") -> None:
        """Idempotent, any state: reserved → released; importing → discarded on arrival;
        running → finished and freed at the next step boundary. From a router process
        (`consumer`) that no longer owns the request (another took it over), nothing."""
        owner = self.outboxes.consumer_of(req_id)
        if consumer and owner is not None and owner != consumer:
            return
        self.outboxes.forget(req_id)
        self.bury(req_id)
        self._starting.pop(req_id, None)
        outcome = AbortOutcome.NOT_HELD if self._book is None else self.book.abort(req_id)
        if outcome is AbortOutcome.DROPPED:
            self._sources.pop(req_id, None)
            await self.on_engine(lambda: self.core.release(req_id))
            return
        if outcome is AbortOutcome.IMPORTING:
            # Its bytes may still be landing in its blocks. The receiver frees them once
            # nothing writes into them any more (a block freed now could go to another
            # request and be overwritten by this one's KV).
            return
        await self.on_engine(lambda: self._abort_on_engine(req_id))

    def _abort_on_engine(self, req_id: str) -> None:
        self.core.abort(req_id)
        self.core.release(req_id)  # blocks of a request detached to move, if any

    async def shutdown(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        await asyncio.gather(*(self.disconnect_sender(p) for p in list(self.send_channels)))
        await super().shutdown()


# The router's calls (engine/worker/contract.py): a verb missing or mistyped fails mypy.
_ANSWERS: type[DecodeCalls] = DecodeWorker
