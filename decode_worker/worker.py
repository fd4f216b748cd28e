"""Decode pool worker: reserves blocks, imports KV hand-offs, decodes every running request.

Block ownership on this side:
* reserve() allocates blocks under the request id with a lease; nothing is ever
  received into memory that was not reserved first.
* import_kv() always drains the sender's message (so the pair's channel stays in
  step), then validates the hand-off against the reservation and this worker's
  epoch; a stale or mismatched one is refused loudly and its data discarded.
* Aborts are idempotent and may arrive in any state: reserved, importing, running.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from engine.core.request import Request, RequestStatus
from engine.core.scheduler import RequestUpdate
from engine.transfer.kv_transfer import Handoff
from engine.worker import WorkerBase

log = logging.getLogger(__name__)

DEFAULT_LEASE_S = 30.0


@dataclass(frozen=True)
class Reservation:
    rank: int
    epoch: str
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class TokenBatch:
    """All new tokens of one or more steps, for every request, in one message."""

    # (req_id, new tokens, finish reason, prompt tokens served from the prefix cache)
    updates: tuple[tuple[str, tuple[int, ...], str | None, int], ...]


class HandoffRefused(RuntimeError):
    pass


class DecodeWorker(WorkerBase):
    role = "decode"

    def __init__(self, args: Any, index: int) -> None:
        super().__init__(args, index)
        self._reserved: dict[str, tuple[int, ...]] = {}
        self._leases: dict[str, asyncio.TimerHandle] = {}
        self._importing: set[str] = set()
        self._aborted: set[str] = set()
        self._outbox: list[tuple[str, tuple[int, ...], str | None, int]] = []
        self._outbox_ready = asyncio.Event()
        # Per source rank: the sequence number whose receive must be posted next.
        self._next_seq: dict[int, int] = {}
        self._turn = asyncio.Condition()

    # ---------------------------------------------------------------- reservation
    async def reserve(
        self, req_id: str, num_tokens: int, lease_s: float = DEFAULT_LEASE_S
    ) -> Reservation | None:
        """Hold blocks for num_tokens of incoming KV; None when they don't fit now."""
        block_ids = await self.on_engine(lambda: self.core.scheduler.reserve(req_id, num_tokens))
        if block_ids is None:
            return None
        if self.is_buried(req_id):  # aborted while this call was on its way
            await self.on_engine(lambda: self.core.scheduler.release(req_id))
            return None
        self._reserved[req_id] = tuple(block_ids)
        self._leases[req_id] = asyncio.get_running_loop().call_later(
            lease_s, lambda: asyncio.ensure_future(self._expire(req_id))
        )
        return Reservation(self.rank, self.epoch, tuple(block_ids))

    async def _expire(self, req_id: str) -> None:
        if req_id in self._reserved and req_id not in self._importing:
            log.warning("reservation for %s expired before its KV arrived; freeing", req_id)
            await self._release_reservation(req_id)

    async def _release_reservation(self, req_id: str) -> None:
        self._reserved.pop(req_id, None)
        lease = self._leases.pop(req_id, None)
        if lease is not None:
            lease.cancel()
        await self.on_engine(lambda: self.core.scheduler.release(req_id))

    # ---------------------------------------------------------------- import
    async def import_kv(self, h: Handoff) -> float:
        """Receive a request's KV into its reservation and start decoding it; returns the
        seconds the receive took once posted (the data movement alone)."""
        if h.dst_rank != self.rank:
            raise HandoffRefused(
                f"hand-off for {h.req_id} addressed to rank {h.dst_rank}, not {self.rank}"
            )
        layout = self.built.layout if self.built else None
        assert layout is not None and self.agent is not None
        staging = torch.empty(
            (
                len(h.src_block_ids),
                layout.num_layers,
                2,
                layout.block_size,
                layout.num_kv_heads,
                layout.head_dim,
            ),
            dtype=self.runner.kv_cache.dtype,
            device=self.runner.kv_cache.device,
        )
        problem = self._check(h)
        owns_reservation = problem is None  # a refused duplicate must not free the real one
        if owns_reservation:
            self._importing.add(h.req_id)
        try:
            async with self._turn:
                await self._turn.wait_for(lambda: self._next_seq.get(h.src_rank, 0) == h.seq_no)
                received = asyncio.wrap_future(self.agent.recv(h.src_rank, staging, h.seq_no))
                self._next_seq[h.src_rank] = h.seq_no + 1
                self._turn.notify_all()
            posted = time.perf_counter()
            await received
            wire_s = time.perf_counter() - posted
            if problem is None and h.req_id in self._aborted:
                problem = "request was aborted during the transfer"
            if problem is not None:
                raise HandoffRefused(f"refused hand-off of {h.req_id}: {problem}")
            self._reserved.pop(h.req_id, None)
            lease = self._leases.pop(h.req_id, None)
            if lease is not None:
                lease.cancel()
            # Acknowledge as soon as the bytes are here: admission runs at the next step
            # boundary without holding up the sender. Engine commands run in order, so
            # any abort issued from now on is applied after the admission.
            self.loop_thread.submit(lambda: self._admit(h, staging)).add_done_callback(
                lambda fut: self._admit_failed(h.req_id, fut.exception())
            )
            if h.req_id in self._aborted:
                await self.on_engine(lambda: self.core.abort(h.req_id))
            return wire_s
        except BaseException:
            if owns_reservation:
                await self._release_reservation(h.req_id)
            raise
        finally:
            if owns_reservation:
                self._importing.discard(h.req_id)
                self._aborted.discard(h.req_id)

    def _admit_failed(self, req_id: str, exc: BaseException | None) -> None:
        # Engine thread. Never expected; if it happens, free the blocks and tell the router.
        if exc is None:
            return
        log.error("admitting %s after its hand-off failed: %r", req_id, exc)
        self.core.scheduler.release(req_id)
        self._loop.call_soon_threadsafe(self._outbox_error, req_id)

    def _outbox_error(self, req_id: str) -> None:
        self._outbox.append((req_id, (), "error", 0))
        self._outbox_ready.set()

    def _check(self, h: Handoff) -> str | None:
        if h.dst_epoch != self.epoch:
            return f"addressed to epoch {h.dst_epoch}, this worker is epoch {self.epoch}"
        reserved = self._reserved.get(h.req_id)
        if reserved is None:
            return "no reservation (expired or aborted)"
        if h.req_id in self._importing:
            return "already importing"
        if tuple(h.dst_block_ids) != reserved:
            return (
                f"destination blocks {list(h.dst_block_ids)} are not the reserved {list(reserved)}"
            )
        if len(h.src_block_ids) != len(reserved):
            return f"{len(h.src_block_ids)} source blocks for {len(reserved)} reserved"
        needed = -(-h.num_computed_tokens // self.built.layout.block_size)  # type: ignore[union-attr]
        if needed != len(reserved):
            return f"{h.num_computed_tokens} tokens need {needed} blocks, {len(reserved)} reserved"
        return None

    def _admit(self, h: Handoff, staging: torch.Tensor) -> None:
        # Engine thread: write the KV, then the request joins the running set.
        self.runner.scatter_blocks(list(h.dst_block_ids), staging)
        spec = self.built.spec  # type: ignore[union-attr]
        req = Request(
            req_id=h.req_id,
            prompt_token_ids=list(h.prompt_token_ids),
            sampling=h.sampling,
            seed=h.seed,
            eos_token_ids=frozenset(spec.eos_token_ids),
            priority=h.priority,
            max_model_len=spec.max_model_len,
            output_token_ids=[h.first_token],
            num_computed_tokens=h.num_computed_tokens,
            status=RequestStatus.RUNNING,
        )
        self.core.scheduler.add_running(req)

    # ---------------------------------------------------------------- tokens out
    def on_updates(self, updates: list[RequestUpdate]) -> None:
        for upd in updates:
            reason = upd.finish_reason.value if upd.finish_reason else None
            self._outbox.append((upd.req_id, upd.new_token_ids, reason, upd.num_cached_tokens))
        self._outbox_ready.set()

    async def next_tokens(self, wait_s: float = 1.0) -> TokenBatch:
        """Long-poll: every token produced since the last call (empty after wait_s)."""
        if not self._outbox:
            self._outbox_ready.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._outbox_ready.wait(), wait_s)
        out, self._outbox = self._outbox, []
        return TokenBatch(tuple(out))

    # ---------------------------------------------------------------- abort
    async def abort(self, req_id: str) -> None:
        """Idempotent, any state: reserved → released; importing → discarded on arrival;
        running → finished and freed at the next step boundary."""
        self.bury(req_id)
        if req_id in self._importing:
            self._aborted.add(req_id)
            return
        if req_id in self._reserved:
            await self._release_reservation(req_id)
            return
        await self.on_engine(lambda: self.core.abort(req_id))
