"""Prefill pool worker: runs prompts, samples the first token, sends the KV to decode.

A request's life here: queued → prefilling (chunks, prefix cache) → first token sampled
→ its blocks gathered into one send buffer on the engine thread and released at once
(into the prefix cache) → header + payload posted on the channel of the decode worker
that reserved room → the reply to the router carries the first token. No call to the
decode worker sits on this path: the decode side checks the header against its
reservation and reports problems in its own token stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from engine.core.kv_events import KVEvents
from engine.core.outputs import GenerationInput
from engine.core.request import FinishReason
from engine.core.scheduler import RequestUpdate
from engine.transfer.channel import SENDER_RANK, ChannelSpec
from engine.transfer.handoff import HandoffHeader, HeaderKind, Reservation
from engine.worker import WorkerBase

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillResult:
    """First token, and how the request goes on."""

    first_token: int | None
    # None: the KV went to decode, which continues the request. Otherwise the request
    # ended here (STOP/LENGTH on its first token, ABORT, or ERROR with `error`).
    finish_reason: FinishReason | None
    num_cached_tokens: int
    prefill_s: float
    transfer_s: float = 0.0  # header + payload handed to the channel until sent
    transfer_bytes: int = 0
    error: str = ""
    kv_events: tuple[KVEvents, ...] = ()  # this worker's prefix-cache changes, for routing


class PrefillAborted(Exception):
    pass


@dataclass(frozen=True)
class _Prefilled:
    """A finished prefill for one request, with its KV already gathered for the hand-off."""

    update: RequestUpdate
    payload: torch.Tensor | None
    ready: torch.cuda.Event | None  # recorded after the gather (CUDA)


class PrefillWorker(WorkerBase):
    pool = "prefill"
    keeps_kv_after_first_token = True

    def __init__(self, args: Any, index: int) -> None:
        super().__init__(args, index)
        self._waiters: dict[str, asyncio.Future[_Prefilled]] = {}

    def channel_rank(self) -> int:
        return SENDER_RANK

    def channel_peer(self, spec: ChannelSpec) -> str:
        return spec.decode_id

    def _updates_from_thread(self, updates: list[RequestUpdate]) -> None:
        # Engine thread, between two steps: gather each hand-off's blocks right here
        # (ordered after the step that wrote them) and give the blocks back at once:
        # later kernels on the engine's stream run after the gather.
        prefilled = []
        for upd in updates:
            payload, ready = None, None
            if upd.kv_kept:
                payload = self.runner.gather_blocks(self.core.block_ids(upd.req_id))
                if payload.is_cuda:
                    ready = torch.cuda.Event()
                    ready.record()
                self.core.release(upd.req_id)
            prefilled.append(_Prefilled(upd, payload, ready))
        # After the releases above, so the freed blocks' cache entries are included.
        events = self.core.take_kv_events()
        self._loop.call_soon_threadsafe(self._deliver, prefilled, events)

    def _deliver(self, prefilled: list[_Prefilled], events: KVEvents) -> None:
        self.add_kv_events(events)  # before any reply these wake up
        for item in prefilled:
            waiter = self._waiters.pop(item.update.req_id, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(item)

    async def prefill(self, inp: GenerationInput, target: Reservation | None) -> PrefillResult:
        """Run the prompt; if the request continues, send its KV into `target`. The reply
        also carries the prefix-cache changes since the previous one."""
        result = await self._prefill(inp, target)
        return replace(result, kv_events=self.take_kv_events())

    async def _prefill(self, inp: GenerationInput, target: Reservation | None) -> PrefillResult:
        start = time.perf_counter()
        if self.is_buried(inp.req_id):
            return PrefillResult(None, FinishReason.ABORT, 0, 0.0)
        waiter: asyncio.Future[_Prefilled] = asyncio.get_running_loop().create_future()
        self._waiters[inp.req_id] = waiter
        try:
            # The router validated the prompt and fixed the seed: decode continues the
            # same random stream.
            await self.on_engine(lambda: self.core.add_request(inp, validate=False))
            done = await waiter
        except PrefillAborted:
            return PrefillResult(None, FinishReason.ABORT, 0, time.perf_counter() - start)
        finally:
            self._waiters.pop(inp.req_id, None)
        prefill_s = time.perf_counter() - start
        upd = done.update
        token = upd.new_token_ids[0]
        if not upd.kv_kept:  # the first token ended it
            return PrefillResult(token, upd.finish_reason, upd.num_cached_tokens, prefill_s)
        if target is None:
            return PrefillResult(token, FinishReason.ABORT, upd.num_cached_tokens, prefill_s)
        t0 = time.perf_counter()
        try:
            nbytes = await self._send(inp, token, target, done)
        except Exception as exc:  # noqa: BLE001 - reported to the router as this request's error
            log.warning("hand-off of %s to %s failed: %s", inp.req_id, target.worker_id, exc)
            return PrefillResult(
                token,
                FinishReason.ERROR,
                upd.num_cached_tokens,
                prefill_s,
                time.perf_counter() - t0,
                error=f"KV hand-off to {target.worker_id} failed: {exc}",
            )
        return PrefillResult(
            token, None, upd.num_cached_tokens, prefill_s, time.perf_counter() - t0, nbytes
        )

    async def _send(
        self, inp: GenerationInput, token: int, target: Reservation, done: _Prefilled
    ) -> int:
        payload = done.payload
        assert payload is not None
        if payload.shape[0] != len(target.block_ids):
            raise RuntimeError(
                f"{payload.shape[0]} blocks here, {len(target.block_ids)} reserved on "
                f"{target.worker_id}"
            )
        channel = self.channels.get(target.worker_id)
        if channel is None:
            raise RuntimeError(f"no channel to {target.worker_id}")
        nbytes = int(payload.numel() * payload.element_size())
        header = HandoffHeader(
            kind=HeaderKind.HANDOFF,
            seq_no=channel.next_seq(),  # taken and posted with no await between: in order
            req_id=inp.req_id,
            dst_epoch=target.epoch,
            src_epoch=self.epoch,
            dst_block_ids=target.block_ids,
            num_bytes=nbytes,
            num_computed_tokens=len(inp.prompt_token_ids),
            first_token=token,
        )
        await asyncio.wrap_future(channel.send(header, payload, done.ready))
        return nbytes

    async def abort(self, req_id: str) -> None:
        """Idempotent, any state: queued or prefilling requests end here; once the KV
        is on its way, there is nothing left to free on this side."""
        self.bury(req_id)
        await self.on_engine(lambda: self.core.abort(req_id))
        waiter = self._waiters.pop(req_id, None)
        if waiter is not None and not waiter.done():
            waiter.set_exception(PrefillAborted(req_id))
