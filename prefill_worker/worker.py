"""Prefill pool worker: runs prompts, samples the first token, hands the KV to decode.

Block ownership: the request's blocks stay allocated here (the scheduler
finishes it with HANDOFF and keeps them) until the decode worker acknowledges
the import or the hand-off fails; only then are they released.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from engine.core.outputs import GenerationInput
from engine.core.request import FinishReason
from engine.core.scheduler import RequestUpdate
from engine.transfer.kv_transfer import Handoff
from engine.worker import WorkerBase

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodeTarget:
    """Where the router reserved room for this request's KV."""

    rank: int
    epoch: str
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class PrefillResult:
    """First token, how the prefill ended, and how long each part took."""

    first_token: int | None
    finish_reason: FinishReason  # HANDOFF: decode continues; anything else: request is done
    num_cached_tokens: int
    prefill_s: float
    transfer_s: float = 0.0
    transfer_bytes: int = 0
    error: str = ""
    wire_s: float = 0.0  # receive posted to complete on the decode side
    src_block_ids: tuple[int, ...] = ()  # where the KV was here (diagnostics, tests)


class PrefillAborted(Exception):
    pass


@dataclass(frozen=True)
class _Prefilled:
    """A finished prefill step for one request, with its KV already gathered for hand-off."""

    update: RequestUpdate
    src_block_ids: list[int]
    payload: torch.Tensor | None


class PrefillWorker(WorkerBase):
    role = "prefill"
    handoff_after_first_token = True

    def __init__(self, args: Any, index: int) -> None:
        super().__init__(args, index)
        self._waiters: dict[str, asyncio.Future[RequestUpdate]] = {}
        self._decode_handles: dict[int, Any] = {}

    async def set_peers(self, decode_handles: dict[int, Any]) -> None:
        """Decode actors by rank, so this worker can call import_kv directly."""
        self._decode_handles = dict(decode_handles)

    def _updates_from_thread(self, updates: list[RequestUpdate]) -> None:
        # Engine thread, between two steps: snapshot each hand-off's blocks right here
        # (ordered after the step that wrote them, and no later engine round trip).
        prefilled = []
        for upd in updates:
            src_ids: list[int] = []
            payload = None
            if upd.finish_reason is FinishReason.HANDOFF:
                src_ids = self.core.scheduler.kv.block_ids(upd.req_id)
                payload = self.runner.gather_blocks(src_ids)
            prefilled.append(_Prefilled(upd, src_ids, payload))
        self._loop.call_soon_threadsafe(self._deliver, prefilled)

    def _deliver(self, prefilled: list[_Prefilled]) -> None:
        for item in prefilled:
            waiter = self._waiters.pop(item.update.req_id, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(item)

    async def prefill(self, inp: GenerationInput, target: DecodeTarget | None) -> PrefillResult:
        """Run the prompt; if it continues, send its KV to `target` and wait for the ack."""
        start = time.perf_counter()
        if self.is_buried(inp.req_id):
            return PrefillResult(None, FinishReason.ABORT, 0, 0.0)
        if inp.sampling.seed is None:
            # Decode continues the request's randomness, so the seed must be fixed here.
            inp = replace(inp, sampling=replace(inp.sampling, seed=random.getrandbits(63)))
        waiter: asyncio.Future[_Prefilled] = asyncio.get_running_loop().create_future()
        self._waiters[inp.req_id] = waiter
        try:
            await self.on_engine(lambda: self.core.add_request(inp))
            done = await waiter
        except PrefillAborted:
            return PrefillResult(None, FinishReason.ABORT, 0, time.perf_counter() - start)
        finally:
            self._waiters.pop(inp.req_id, None)
        prefill_s = time.perf_counter() - start
        upd = done.update
        token = upd.new_token_ids[0]
        reason = upd.finish_reason or FinishReason.HANDOFF
        if reason is not FinishReason.HANDOFF:
            return PrefillResult(token, reason, upd.num_cached_tokens, prefill_s)
        if target is None:
            await self.on_engine(lambda: self.core.scheduler.release(inp.req_id))
            return PrefillResult(token, FinishReason.ABORT, upd.num_cached_tokens, prefill_s)
        t0 = time.perf_counter()
        try:
            nbytes, wire_s = await self._handoff(inp, token, target, done)
        except Exception as exc:  # noqa: BLE001 - reported to the router as this request's error
            log.warning("hand-off of %s failed: %s", inp.req_id, exc)
            return PrefillResult(
                token,
                FinishReason.ERROR,
                upd.num_cached_tokens,
                prefill_s,
                time.perf_counter() - t0,
                0,
                f"KV hand-off failed: {exc}",
            )
        return PrefillResult(
            token,
            FinishReason.HANDOFF,
            upd.num_cached_tokens,
            prefill_s,
            time.perf_counter() - t0,
            nbytes,
            wire_s=wire_s,
            src_block_ids=tuple(done.src_block_ids),
        )

    async def _handoff(
        self, inp: GenerationInput, token: int, target: DecodeTarget, done: _Prefilled
    ) -> tuple[int, float]:
        req_id = inp.req_id
        src_ids, payload = done.src_block_ids, done.payload
        try:
            assert payload is not None
            if len(src_ids) != len(target.block_ids):
                raise RuntimeError(
                    f"block count mismatch for {req_id}: {len(src_ids)} here, "
                    f"{len(target.block_ids)} reserved on decode rank {target.rank}"
                )
            handle = self._decode_handles.get(target.rank)
            if handle is None:
                raise RuntimeError(f"no decode worker at rank {target.rank}")
            assert self.agent is not None
            seq = self.agent.next_seq(target.rank)
            sent = asyncio.wrap_future(self.agent.send(target.rank, payload, seq))
            handoff = Handoff(
                req_id=req_id,
                src_rank=self.rank,
                dst_rank=target.rank,
                seq_no=seq,
                dst_epoch=target.epoch,
                src_block_ids=tuple(src_ids),
                dst_block_ids=target.block_ids,
                num_computed_tokens=len(inp.prompt_token_ids),
                prompt_token_ids=inp.prompt_token_ids,
                first_token=token,
                sampling=inp.sampling,
                seed=inp.sampling.seed or 0,
                priority=inp.priority,
            )
            # Both must finish: the decode side acknowledges only after receiving.
            wire_s, _ = await asyncio.gather(handle.import_kv.remote(handoff), sent)
            return int(payload.numel() * payload.element_size()), wire_s
        finally:
            # Acknowledged or failed: the blocks come back here either way (into
            # the prefix cache, where later prompts sharing the prefix hit them).
            await self.on_engine(lambda: self.core.scheduler.release(req_id))

    async def abort(self, req_id: str) -> None:
        """Idempotent; a request mid-transfer finishes its transfer, then frees its blocks."""
        # Only queued or prefilling requests are aborted here: blocks held for an
        # in-flight hand-off are released by _handoff once the transfer settles.
        self.bury(req_id)
        await self.on_engine(lambda: self.core.abort(req_id))
        waiter = self._waiters.pop(req_id, None)
        if waiter is not None and not waiter.done():
            waiter.set_exception(PrefillAborted(req_id))
