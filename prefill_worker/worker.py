"""Prefill pool worker: runs prompts, samples the first token, sends the KV on.

A request's life here: queued → prefilling (chunks, prefix cache) → first token sampled
→ at that step boundary, on the engine thread, the step's hand-offs are planned (every
request that goes to the same receiver in one message), their blocks released (into
the prefix cache), the first tokens handed to the event loop, and then each message
gathered into one send buffer (one `index_select`) and posted, header + payload, on the
pair's channel → the reply to the router carries the first token without waiting for
the post or the bytes: the receiver checks each entry against its reservation and
reports arrival, refusal or a broken transfer in its own token stream.

A message of at least `stream_min_tokens` prompt tokens (`--kv-stream-min-tokens`; by
default the count whose KV reaches 256 MiB: one long prompt, or a pass's worth of short
ones; with that default, not a prompt that runs alone from a prompt CUDA graph,
engine.model.prompt_graphs) streams instead (engine.transfer.streaming): it opens
before the pass that completes its prompts, each group of layers leaves as soon as the
pass has written it, and the step boundary only adds the trailer with the first tokens.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from engine.core.batch import Batch
from engine.core.request import FinishReason
from engine.core.role import EngineRole
from engine.factory import kv_stream_min_tokens
from engine.model.startup.startup_log import log as startup_log
from engine.transfer.base import KVPoll, KVSender, PairChannel, TransferHandle
from engine.transfer.channel import SENDER_RANK
from engine.transfer.sender import Message, ReadyKV, plan_messages
from engine.transfer.streaming import StepStream, open_stream
from engine.wire import (
    NO_TOKEN,
    ChannelSpec,
    GenerationInput,
    HandoffHeader,
    HandoffTarget,
    KVEvents,
    PrefillResult,
    Reservation,
    TokenUpdate,
)
from engine.worker.actor import WorkerBase
from engine.worker.contract import PrefillCalls
from engine.worker.phases import prompt_phases, record_kv_send

log = logging.getLogger(__name__)


class PrefillAborted(Exception):
    pass


class _Posting:
    """The message that carries a request's KV, as the event loop learns of it: the
    engine thread hands a step's first tokens over before it posts the step's
    messages, so the reply may leave before the message's handle is here."""

    def __init__(self) -> None:
        self.handle: TransferHandle | None = None
        self.header: HandoffHeader | None = None
        self._callbacks: list[Callable[[KVPoll], None]] = []

    def posted(self, handle: TransferHandle, header: HandoffHeader | None = None) -> _Posting:
        """Event loop: the message is on the channel."""
        self.handle, self.header = handle, header
        for fn in self._callbacks:
            handle.add_done_callback(fn)
        self._callbacks.clear()
        return self

    @property
    def failure(self) -> str | None:
        """Why the send failed, once it has; None while it has not (or is not posted)."""
        if self.handle is None or self.handle.poll() is not KVPoll.FAILED:
            return None
        return self.handle.failure or "failed"

    def add_done_callback(self, fn: Callable[[KVPoll], None]) -> None:
        """fn(state) when the send ends, posted now or later."""
        if self.handle is None:
            self._callbacks.append(fn)
        else:
            self.handle.add_done_callback(fn)


@dataclass(frozen=True)
class _Prefilled:
    """A finished prefill for one request, and what became of its KV."""

    update: TokenUpdate
    ready_at: float  # time.monotonic() when its step's tokens were out (the KV ready)
    message: _Posting | None = None  # the message that carries its KV
    num_bytes: int = 0
    error: str = ""  # the KV could not be posted


class PrefillWorker(WorkerBase):
    pool = "prefill"
    role = EngineRole.PREFILL
    contract = PrefillCalls

    def __init__(
        self, args: Any, index: int, tracing_config: Any = None, tp_group: Any = None
    ) -> None:
        super().__init__(args, index, tracing_config, tp_group)
        self._waiters: dict[str, asyncio.Future[_Prefilled]] = {}
        # Where each request's KV goes, and how many tokens of it (read on the engine
        # thread, set before the request reaches it).
        self._targets: dict[str, tuple[HandoffTarget, int]] = {}
        self._open_streams: list[StepStream] = []  # engine thread only
        self.num_streamed_messages = 0
        self.stream_min_tokens = 0  # set at start, from the KV's size per token
        # With the default threshold, a prompt graph wins over streaming; a threshold the
        # operator set streams every prompt at least that long.
        self._graphs_over_streaming = self.args.kv_stream_min_tokens == "auto"

    def on_started(self) -> None:
        self.stream_min_tokens = kv_stream_min_tokens(
            self.args.kv_stream_min_tokens, self.block_bytes / self.args.block_size
        )
        # A streamed message's trailer needs its step's tokens right after the pass,
        # which an engine scheduling one step ahead does not give.
        if not self.core.async_scheduling:
            self.runner.step_observer = self._stream_step
            startup_log.info(  # a start-up fact: shown where the start-up lines are
                "%s: hand-offs of %d prompt tokens or more (one pass's, to one decode worker) "
                "stream layer by layer",
                self.worker_id,
                self.stream_min_tokens,
            )

    def _stream_step(self, batch: Batch) -> StepStream | None:
        """Engine thread, before a pass: open streamed messages for the prompts it
        completes that go on to a decode worker, where a message is large enough."""
        graphs = self.runner.prompt_graphs
        if self._graphs_over_streaming and graphs is not None and graphs.can_run(batch):
            # A lone prompt a CUDA graph runs sends its KV in one message after the pass:
            # the eager pass that streams costs its first token more than the hand-off it
            # hides after it (docs/benchmarks.md, "KV hand-off").
            return None
        ready: list[ReadyKV] = []
        for seq in batch.seqs:
            destination = self._targets.get(seq.req_id) if seq.sample else None
            if destination is None:
                continue
            target, num_tokens = destination
            if seq.end_position != num_tokens:
                continue
            num_blocks = -(-num_tokens // batch.block_size)
            ready.append(
                ReadyKV(seq.req_id, target, seq.block_table[:num_blocks], num_tokens, NO_TOKEN)
            )
        messages: list[tuple[Message, KVSender]] = []
        for message in plan_messages(ready, self.block_bytes):
            # The message's size decides, not a prompt's: a burst of short prompts that
            # finish in one pass makes one large message, and that pass is long enough
            # to hide most of it.
            if message.num_tokens < self.stream_min_tokens:
                continue  # sent whole after the pass
            channel = self.channels.get(message.target.worker_id)
            spec = getattr(channel, "spec", None)
            if spec is not None and spec.splits_heads:
                continue  # tensor-parallel parts move after the pass (engine.transfer.tp_parts)
            if channel is not None and not channel.closed:  # else: fails after the step
                messages.append((message, channel))
        if not messages:
            return None
        stream = open_stream(
            messages,
            src_epoch=self.epoch,
            num_layers=self.runner.kv_cache.shape[1],
            block_bytes=self.block_bytes,
            gather=self._gather_layers,
            index_of=self.runner.block_index,
        )
        self._open_streams.append(stream)
        self.num_streamed_messages += len(messages)
        return stream

    def _gather_layers(
        self, block_index: torch.Tensor, layers: tuple[int, int]
    ) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """One part of a streamed message, gathered on the engine's stream right behind
        the layer that wrote it; the event tells the channel when it is ready."""
        payload = self.runner.gather_blocks(block_index, layers)
        if not payload.is_cuda:
            return payload, None
        event = torch.cuda.Event()
        event.record()
        return payload, event

    def _close_streams(self, updates: list[TokenUpdate]) -> dict[str, TransferHandle]:
        """End the streamed messages of the pass just run: each entry's first token, or
        none where the request does not continue (finished, or aborted meanwhile)."""
        streams, self._open_streams = self._open_streams, []
        first_tokens = {
            u.req_id: u.new_token_ids[0]
            for u in updates
            if u.hand_off and u.req_id in self._targets
        }
        handles: dict[str, TransferHandle] = {}
        for stream in streams:
            if not stream.closed:  # a failed pass closed its own
                handles.update(stream.close(first_tokens))
        return handles

    def channel_rank(self) -> int:
        return SENDER_RANK

    def channel_peer(self, spec: ChannelSpec) -> str:
        return spec.receiver_id

    def _updates_from_thread(self, updates: list[TokenUpdate]) -> None:
        # Engine thread, between two steps. The step's first tokens go to the event loop
        # before its hand-offs are posted, so the replies to the router do not wait for
        # the gathers and headers. The blocks are released before the posts (into the
        # prefix cache, so the replies carry those cache changes): no kernel runs
        # between a release and its message's gather, which follows on this thread and
        # stream before the next step, so nothing overwrites the blocks first.
        ready_at = time.monotonic()
        outcome: dict[str, _Prefilled] = {}
        streamed = self._close_streams(updates)
        ready: list[ReadyKV] = []
        for upd in updates:
            if not upd.hand_off:
                continue
            destination = self._targets.get(upd.req_id)
            if destination is None:  # aborted meanwhile: nobody waits for this KV
                self.core.release(upd.req_id)
                continue
            target, num_tokens = destination
            handle = streamed.get(upd.req_id)
            if handle is not None:  # its parts were gathered during the pass
                num_blocks = len(self.core.block_ids(upd.req_id))
                self.core.release(upd.req_id)
                outcome[upd.req_id] = _Prefilled(
                    upd, ready_at, _Posting().posted(handle), num_blocks * self.block_bytes
                )
                continue
            block_ids = tuple(self.core.block_ids(upd.req_id))
            ready.append(ReadyKV(upd.req_id, target, block_ids, num_tokens, upd.new_token_ids[0]))
        by_id = {u.req_id: u for u in updates}
        to_post: list[tuple[Message, PairChannel, _Posting]] = []
        for message in plan_messages(ready, self.block_bytes):
            channel = self.channels.get(message.target.worker_id)
            posting = None if channel is None or channel.closed else _Posting()
            for item in message.items:
                self.core.release(item.req_id)
                if posting is None:
                    error = f"no channel to {message.target.worker_id}"
                    outcome[item.req_id] = _Prefilled(by_id[item.req_id], ready_at, error=error)
                else:
                    num_bytes = len(item.block_ids) * self.block_bytes
                    outcome[item.req_id] = _Prefilled(
                        by_id[item.req_id], ready_at, posting, num_bytes
                    )
            if channel is not None and posting is not None:
                to_post.append((message, channel, posting))
        prefilled = [outcome.get(u.req_id) or _Prefilled(u, ready_at) for u in updates]
        events = self.core.take_kv_events()
        self._loop.call_soon_threadsafe(self._deliver, prefilled, events)
        posted = [(p, *self.post_message(c, m)) for m, c, p in to_post]
        if posted:
            self._loop.call_soon_threadsafe(_mark_posted, posted)

    def _deliver(self, prefilled: list[_Prefilled], events: KVEvents) -> None:
        self.add_kv_events(events)  # before any reply these wake up
        for item in prefilled:
            waiter = self._waiters.pop(item.update.req_id, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(item)

    async def prefill(
        self, inp: GenerationInput, target: HandoffTarget | Reservation | None
    ) -> PrefillResult:
        """Run the prompt; if the request continues, send its KV to `target` (the
        receiver checks it against the reservation it holds for this request). The
        reply also carries the prefix-cache changes since the previous one."""
        if isinstance(target, Reservation):
            target = target.target
        result = await self._prefill(inp, target)
        return replace(result, kv_events=self.take_kv_events(inp.consumer))

    async def _prefill(self, inp: GenerationInput, target: HandoffTarget | None) -> PrefillResult:
        start = time.perf_counter()
        arrived_at = time.monotonic()
        if self.is_buried(inp.req_id):
            return PrefillResult(None, FinishReason.ABORT, 0, 0.0)
        waiter: asyncio.Future[_Prefilled] = asyncio.get_running_loop().create_future()
        self._waiters[inp.req_id] = waiter
        if target is not None:
            self._targets[inp.req_id] = (target, len(inp.prompt_token_ids))
        try:
            # The router validated the prompt and fixed the seed: the receiver continues
            # the same random stream.
            await self.on_engine(lambda: self.core.add_request(inp, validate=False))
            done = await waiter
        except PrefillAborted:
            return PrefillResult(None, FinishReason.ABORT, 0, time.perf_counter() - start)
        finally:
            self._waiters.pop(inp.req_id, None)
            self._targets.pop(inp.req_id, None)
        prefill_s = time.perf_counter() - start
        upd = done.update
        token = upd.new_token_ids[0]
        cached = upd.num_cached_tokens
        phases = prompt_phases(self.pool, self.worker_id, inp, arrived_at, upd, done.ready_at)
        if not upd.hand_off:  # the first token ended it
            return PrefillResult(token, upd.finish_reason, cached, prefill_s, phases=phases)
        if target is None:
            return PrefillResult(token, FinishReason.ABORT, cached, prefill_s)
        message = done.message
        failure = done.error or (message.failure if message else None)
        if message is None or failure:
            log.warning("hand-off of %s to %s failed: %s", inp.req_id, target.worker_id, failure)
            return PrefillResult(
                token,
                FinishReason.ERROR,
                cached,
                prefill_s,
                error=f"KV hand-off to {target.worker_id} failed: {failure}",
                phases=phases,
            )
        req_id, peer = inp.req_id, target.worker_id
        message.add_done_callback(lambda state: _log_failure(state, message, req_id, peer))
        if inp.trace_context:
            message.add_done_callback(self._kv_send_tracer(inp, target, done, message))
        return PrefillResult(token, None, cached, prefill_s, done.num_bytes, phases=phases)

    def _kv_send_tracer(
        self, inp: GenerationInput, target: HandoffTarget, done: _Prefilled, message: _Posting
    ) -> Callable[[KVPoll], None]:
        """Records a traced request's `kv.send` span when its message is sent (for a
        streamed one: its last parts and trailer, the rest left during the pass)."""

        def record(state: KVPoll) -> None:
            span = (done.ready_at, time.monotonic())
            failure = message.failure or ""
            record_kv_send(
                self.worker_id, inp, target, message.header, done.num_bytes, span, state, failure
            )

        return record

    async def abort(self, req_id: str, consumer: str = "") -> None:
        """Idempotent, any state: queued or prefilling requests end here; once the KV
        is on its way, there is nothing left to free on this side. (`consumer`, the
        router process asking, matters only on a decode worker.)"""
        self.bury(req_id)
        self._targets.pop(req_id, None)
        await self.on_engine(lambda: self.core.abort(req_id))
        waiter = self._waiters.pop(req_id, None)
        if waiter is not None and not waiter.done():
            waiter.set_exception(PrefillAborted(req_id))

    async def next_kv_events(self, wait_s: float = 1.0, consumer: str = "") -> tuple[KVEvents, ...]:
        """Long-poll: the prefix-cache changes `consumer` has not read (empty after
        wait_s), for a router process whose own prompts do not come here often enough."""
        return await self.kv_fanout.wait(consumer, wait_s)


def _log_failure(state: KVPoll, message: _Posting, req_id: str, peer: str) -> None:
    # The receiver ends the request (a broken channel, or an unfilled reservation's
    # lease); this side only records what it saw.
    if state is KVPoll.FAILED:
        log.warning("hand-off of %s to %s failed after posting: %s", req_id, peer, message.failure)


def _mark_posted(posted: list[tuple[_Posting, HandoffHeader, TransferHandle]]) -> None:
    """Event loop: a step's messages are on their channels."""
    for posting, header, handle in posted:
        posting.posted(handle, header)


# The router's calls (engine/worker/contract.py), checked by mypy: a verb this class
# lacks, or takes other arguments to, fails type-checking here.
_ANSWERS: type[PrefillCalls] = PrefillWorker
