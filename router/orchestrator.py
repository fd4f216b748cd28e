"""The router's serving core: drives each request through reserve → prefill → transfer → decode.

State machine per request (DESIGN.md): RECEIVED → VALIDATED → QUEUED →
DECODE_RESERVED → PREFILLING → TRANSFERRING → DECODING → FINISHED. Whatever ends
a request (finish, client cancel, deadline, worker death), the `finally` of
`generate` aborts it on both workers it touched; aborts are idempotent there.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from ray.exceptions import RayActorError

from engine.core.outputs import FinalResult, GenerationInput, PhaseTimings, TextChunk, Usage
from engine.core.request import FinishReason
from engine.core.validation import validate_prompt
from engine.frontend.output_processor import OutputProcessor
from engine.frontend.prompt import encode_prompt
from prefill_worker.worker import DecodeTarget, PrefillResult
from router.admission import Admission
from router.config import RouterConfig
from router.errors import NotReadyError, QueueFullError
from router.policy import WorkerLoadView, pick_least_loaded
from router.protocol import GenerateCall, PoolStats, ServerInfo

log = logging.getLogger("pdserve.router")
T = TypeVar("T")


@dataclass
class WorkerRef:
    """The router's view of one worker actor."""

    pool: str
    index: int
    handle: Any
    info: Any  # engine.worker.WorkerInfo
    alive: bool = True
    num_assigned: int = 0

    def view(self) -> WorkerLoadView:
        return WorkerLoadView(self.index, self.alive, self.num_assigned)


@dataclass
class _Stream:
    """Per-request inbox for the decode worker's token batches."""

    queue: asyncio.Queue[tuple[tuple[int, ...], str | None, int] | BaseException] = field(
        default_factory=asyncio.Queue
    )
    decode_index: int = -1


class DisaggregatedGenerator:
    """Implements router.protocol.Generator over prefill and decode Ray actors."""

    def __init__(
        self,
        prefill: list[WorkerRef],
        decode: list[WorkerRef],
        tokenizer: Any,
        config: RouterConfig | None = None,
        colocated: list[WorkerRef] | None = None,
    ) -> None:
        self.colocated = colocated or []
        if not self.colocated and (not prefill or not decode):
            raise ValueError("need at least one prefill and one decode worker, or colocated ones")
        self.prefill = prefill
        self.decode = decode
        self.tokenizer = tokenizer
        self.config = config or RouterConfig()
        self.admission = Admission(self.config.max_in_flight, self.config.max_queue)
        self.outputs = OutputProcessor(tokenizer)
        self._streams: dict[str, _Stream] = {}
        self._pollers: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[Any]] = set()
        self._ready = False
        infos = [w.info for w in prefill + decode + self.colocated]
        self.max_model_len = min(i.max_model_len for i in infos)
        self.vocab_size = min(i.vocab_size for i in infos)
        block_size = infos[0].layout.block_size
        self.max_cache_tokens = min(i.num_blocks for i in infos) * block_size
        self.block_size = block_size
        self.model_name = infos[0].model_name

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start one long-poll per decode worker; mark ready."""
        for ref in self.decode + self.colocated:
            self._pollers.append(asyncio.create_task(self._poll(ref)))
        self._ready = True

    async def stop(self) -> None:
        self._ready = False
        for task in self._pollers:
            task.cancel()
        await asyncio.gather(*self._pollers, return_exceptions=True)

    def is_ready(self) -> bool:
        if self.colocated:
            return self._ready and any(w.alive for w in self.colocated)
        return (
            self._ready and any(w.alive for w in self.prefill) and any(w.alive for w in self.decode)
        )

    def server_info(self) -> ServerInfo:
        return ServerInfo(
            model=self.model_name,
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            num_prefill_workers=len(self.prefill),
            num_decode_workers=len(self.decode) + len(self.colocated),
            max_in_flight=self.admission.max_in_flight,
            max_queue=self.admission.max_queue,
        )

    async def pool_stats(self) -> PoolStats:
        refs = [w for w in self.prefill + self.decode + self.colocated if w.alive]
        loads = await asyncio.gather(
            *(w.handle.load.remote() for w in refs), return_exceptions=True
        )
        workers = [load for load in loads if not isinstance(load, BaseException)]
        return PoolStats(tuple(workers), self.admission.num_in_flight, self.admission.num_queued)

    # ---------------------------------------------------------------- token delivery
    async def _poll(self, ref: WorkerRef) -> None:
        """One remote call per batch of steps for all of a decode worker's requests."""
        while True:
            try:
                batch = await ref.handle.next_tokens.remote()
            except asyncio.CancelledError:
                raise
            except RayActorError as exc:
                self._mark_dead(ref, exc)
                return
            for req_id, tokens, reason, cached in batch.updates:
                stream = self._streams.get(req_id)
                if stream is not None:
                    stream.queue.put_nowait((tokens, reason, cached))

    def _mark_dead(self, ref: WorkerRef, exc: BaseException) -> None:
        if not ref.alive:
            return
        ref.alive = False
        log.error("%s worker %d died: %s", ref.pool, ref.index, exc)
        if ref.pool in ("decode", "colocated"):
            for stream in list(self._streams.values()):
                if stream.decode_index == ref.index:
                    stream.queue.put_nowait(RuntimeError(f"decode worker {ref.index} died"))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort_on(self, ref: WorkerRef | None, req_id: str) -> None:
        if ref is None or not ref.alive:
            return
        try:
            await ref.handle.abort.remote(req_id)
        except RayActorError as exc:
            self._mark_dead(ref, exc)

    # ---------------------------------------------------------------- requests
    def _to_input(self, call: GenerateCall) -> GenerationInput:
        messages = None
        if call.messages is not None:
            messages = [(m.role, m.content) for m in call.messages]
        token_ids = encode_prompt(
            self.tokenizer,
            prompt=call.prompt,
            prompt_token_ids=call.prompt_token_ids,
            messages=messages,
        )
        validate_prompt(
            token_ids,
            call.sampling,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            max_cache_tokens=self.max_cache_tokens,
        )
        # Workers see a fresh internal id: a client may reuse its own ids, and an
        # aborted id is remembered by the workers for a while.
        req_id = uuid.uuid4().hex
        sampling = call.sampling
        if sampling.seed is None:
            # Fixed here so prefill and decode draw from the same stream.
            sampling = replace(sampling, seed=uuid.uuid4().int >> 65)
        return GenerationInput(req_id, tuple(token_ids), sampling, call.priority)

    async def _call_least_loaded(
        self, pool: list[WorkerRef], call: Callable[[WorkerRef], Awaitable[T]], *, hold: bool
    ) -> tuple[WorkerRef, T]:
        """Call the least-loaded live worker of `pool`; a dead one is marked and the next tried.

        The worker counts the request as assigned from before the call, so concurrent
        arrivals spread instead of all picking the one that looked idle a moment ago; with
        `hold` the count stays until the caller gives it back (the request lives there).
        """
        while True:
            idx = pick_least_loaded([w.view() for w in pool])
            if idx is None:
                raise NotReadyError(f"no {pool[0].pool if pool else ''} worker is alive")
            ref = pool[idx]
            ref.num_assigned += 1
            try:
                result = await call(ref)
            except RayActorError as exc:
                ref.num_assigned -= 1
                self._mark_dead(ref, exc)
                continue
            except BaseException:
                ref.num_assigned -= 1
                raise
            if not hold:
                ref.num_assigned -= 1
            return ref, result

    async def _reserve(self, inp: GenerationInput) -> tuple[WorkerRef, Any]:
        """Wait (queued in the router, not dropped) until a decode worker has room."""
        while True:
            ref, res = await self._call_least_loaded(
                self.decode,
                lambda r: r.handle.reserve.remote(
                    inp.req_id, len(inp.prompt_token_ids), self.config.lease_s
                ),
                hold=True,
            )
            if res is not None:
                return ref, res
            ref.num_assigned -= 1
            await asyncio.sleep(self.config.reserve_poll_s)

    async def _submit_colocated(self, inp: GenerationInput, stream: _Stream) -> WorkerRef:
        def submit(ref: WorkerRef) -> Any:
            stream.decode_index = ref.index  # before submit: tokens may come back at once
            return ref.handle.submit.remote(inp)

        ref, _ = await self._call_least_loaded(self.colocated, submit, hold=True)
        return ref

    async def _prefill(
        self, inp: GenerationInput, target: DecodeTarget
    ) -> tuple[WorkerRef, PrefillResult]:
        # A prefill worker that dies before handing off is retried on another one.
        return await self._call_least_loaded(
            self.prefill, lambda r: r.handle.prefill.remote(inp, target), hold=False
        )

    async def generate(self, call: GenerateCall) -> AsyncIterator[TextChunk | FinalResult]:
        """Stream one request's chunks, then exactly one FinalResult."""
        if not self.is_ready():
            raise NotReadyError("pools are not ready")
        arrival = time.perf_counter()
        inp = self._to_input(call)
        req_id = inp.req_id
        user_id = call.request_id or req_id  # what the client knows it by, for the log line
        stream = _Stream()
        self._streams[req_id] = stream
        self.outputs.add(req_id, inp.prompt_token_ids, inp.sampling.stop)
        decode_ref: WorkerRef | None = None
        prefill_ref: WorkerRef | None = None
        finished = False
        num_out = 0
        num_cached = 0
        t_first: float | None = None
        timings = PhaseTimings()

        def final(reason: FinishReason, error: str = "") -> FinalResult:
            end = time.perf_counter()
            t = replace(
                timings,
                decode_s=end - t_decoding if t_decoding else 0.0,
                time_to_first_token_s=(t_first or end) - arrival,
            )
            result = FinalResult(
                reason, Usage(len(inp.prompt_token_ids), num_out, num_cached), t, error
            )
            self._log(user_id, result)
            return result

        t_decoding = 0.0
        try:
            async with self.admission.slot():
                result: PrefillResult | None = None
                reason: FinishReason | None = None
                tokens: tuple[int, ...] = ()
                if self.colocated:
                    # One worker runs both phases: submit, then read its token stream.
                    decode_ref = await self._submit_colocated(inp, stream)
                    timings = PhaseTimings(queued_s=time.perf_counter() - arrival)
                    t_decoding = time.perf_counter()
                else:
                    decode_ref, reservation = await self._reserve(inp)
                    stream.decode_index = decode_ref.index
                    queued_s = time.perf_counter() - arrival
                    target = DecodeTarget(
                        reservation.rank, reservation.epoch, reservation.block_ids
                    )
                    try:
                        prefill_ref, result = await asyncio.wait_for(
                            self._prefill(inp, target), self.config.prefill_timeout_s
                        )
                    except TimeoutError as exc:
                        raise RuntimeError(
                            f"prefill took over {self.config.prefill_timeout_s:.0f}s"
                        ) from exc
                    t_decoding = time.perf_counter()
                    num_cached = result.num_cached_tokens
                    timings = PhaseTimings(
                        queued_s, result.prefill_s, result.transfer_s, kv_wire_s=result.wire_s
                    )
                    if result.finish_reason is FinishReason.ERROR:
                        raise RuntimeError(result.error)
                    # HANDOFF: decode continues; any other reason: the first token ended it.
                    if result.finish_reason is not FinishReason.HANDOFF:
                        reason = result.finish_reason
                    tokens = () if result.first_token is None else (result.first_token,)
                while True:
                    out = self.outputs.process(req_id, tokens, reason)
                    num_out += len(tokens)
                    if out.chunk is not None:
                        t_first = t_first or time.perf_counter()
                        yield out.chunk
                    if out.finish_reason is not None:
                        finished = True
                        if reason is None:  # stop string: the decode side is still going
                            self._spawn(self._abort_on(decode_ref, req_id))
                        elif (
                            result is not None and result.finish_reason is not FinishReason.HANDOFF
                        ):
                            self._spawn(self._abort_on(decode_ref, req_id))  # unused reservation
                        yield final(out.finish_reason)
                        return
                    try:
                        item = await asyncio.wait_for(
                            stream.queue.get(), self.config.token_stall_timeout_s
                        )
                    except TimeoutError as exc:
                        raise RuntimeError(
                            f"no token for {self.config.token_stall_timeout_s:.0f}s"
                        ) from exc
                    if isinstance(item, BaseException):
                        raise item
                    tokens, reason_name, cached = item
                    num_cached = max(num_cached, cached)
                    reason = FinishReason(reason_name) if reason_name else None
        except (QueueFullError, NotReadyError):
            raise
        except Exception as exc:  # noqa: BLE001 - becomes this request's terminal message
            log.error("request %s failed: %s", user_id, exc)
            finished = True
            self._abort_everywhere(req_id, prefill_ref, decode_ref)
            yield final(FinishReason.ERROR, str(exc))
        finally:
            self._streams.pop(req_id, None)
            self.outputs.remove(req_id)
            if decode_ref is not None:
                decode_ref.num_assigned -= 1
            if not finished:
                # Cancelled or timed out, possibly mid-call: abort wherever the request may
                # be. Background tasks, since this generator may be closing on cancellation.
                self._abort_everywhere(req_id, prefill_ref, decode_ref)
                log.info("request %s cancelled after %d tokens", user_id, num_out)

    def _abort_everywhere(
        self, req_id: str, prefill_ref: WorkerRef | None, decode_ref: WorkerRef | None
    ) -> None:
        """Abort on every worker the request may have reached (idempotent there)."""
        for ref in self.prefill if prefill_ref is None else [prefill_ref]:
            self._spawn(self._abort_on(ref, req_id))
        for ref in self.decode + self.colocated if decode_ref is None else [decode_ref]:
            self._spawn(self._abort_on(ref, req_id))

    def _log(self, req_id: str, final: FinalResult) -> None:
        t = final.timings
        log.info(
            "request %s finished=%s prompt=%d out=%d cached=%d queued=%.3fs prefill=%.3fs "
            "kv=%.4fs (wire %.4fs) decode=%.3fs ttft=%.3fs",
            req_id,
            final.finish_reason.value,
            final.usage.prompt_tokens,
            final.usage.completion_tokens,
            final.usage.cached_prompt_tokens,
            t.queued_s,
            t.prefill_s,
            t.kv_transfer_s,
            t.kv_wire_s,
            t.decode_s,
            t.time_to_first_token_s,
        )
