"""The router's serving core: drives each request through its phases on the live pools.

State machine per request (docs/architecture.md): RECEIVED → VALIDATED → QUEUED →
DECODE_RESERVED → PREFILLING → TRANSFERRING → DECODING → FINISHED. Each attempt has its
own internal id; a worker death before any token reached the client starts a new
attempt on other workers, after it nothing can be taken back and the request ends with
ERROR. Whatever ends an attempt (finish, client cancel, deadline, worker death), it is
aborted on every worker it touched; aborts are idempotent there.
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

from engine.core.kv_events import KVEvents
from engine.core.outputs import (
    FinalResult,
    GenerationInput,
    PhaseTimings,
    TextChunk,
    Usage,
)
from engine.core.request import FinishReason
from engine.core.validation import validate_prompt
from engine.frontend.output_processor import OutputProcessor
from engine.frontend.prompt import encode_prompt
from engine.transfer.handoff import Reservation
from prefill_worker.worker import PrefillResult
from router import metrics
from router.admission import Admission
from router.cluster import POOLS
from router.config import RouterConfig
from router.errors import NotReadyError, QueueFullError
from router.inbox import UpdateInbox
from router.kv_index import PrefixIndex
from router.pools import Pools, WorkerRef
from router.protocol import GenerateCall, PoolStats, ServerInfo
from router.routing import choose_worker, load_order

log = logging.getLogger("pdserve.router")
WORKER_WAIT_POLL_S = 0.05
T = TypeVar("T")


class WorkerLost(RuntimeError):
    """A worker this attempt depended on died or could not take it: retry if possible."""


@dataclass
class _Attempt:
    """One try at running a request; its id is what the workers know it by."""

    inp: GenerationInput
    inbox: UpdateInbox = field(default_factory=UpdateInbox)
    decode_ref: WorkerRef | None = None  # holds num_assigned while set
    prefill_ref: WorkerRef | None = None

    @property
    def req_id(self) -> str:
        return self.inp.req_id


@dataclass
class _Progress:
    """What the client has seen so far, across attempts."""

    arrival: float
    num_out: int = 0
    num_cached: int = 0
    t_first: float | None = None
    t_decoding: float = 0.0
    timings: PhaseTimings = field(default_factory=PhaseTimings)
    finish_reason: FinishReason = FinishReason.ERROR  # set when the stream ends


class DisaggregatedGenerator:
    """Implements router.protocol.Generator over the live pools."""

    def __init__(self, pools: Pools, tokenizer: Any, config: RouterConfig | None = None) -> None:
        self.pools = pools
        self.colocated_mode = pools.targets["colocated"] > 0
        self.tokenizer = tokenizer
        self.config = config or RouterConfig()
        self.admission = Admission(
            self.config.max_in_flight,
            self.config.max_queue,
            order=self.config.admission_order,
            aging_s=self.config.priority_aging_s,
        )
        self.outputs = OutputProcessor(tokenizer)
        self._attempts: dict[str, _Attempt] = {}
        self._pollers: dict[WorkerRef, asyncio.Task[None]] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._ready = False
        info = pools.reference
        if info is None:
            raise ValueError("no workers")
        infos = [w.info for w in pools.all()]
        self.max_model_len = min(i.max_model_len for i in infos)
        self.vocab_size = min(i.vocab_size for i in infos)
        self.block_size = info.layout.block_size
        self.max_cache_tokens = min(i.num_blocks for i in infos) * self.block_size
        self.model_name = info.model_name
        pools.on_death.append(self._on_worker_death)
        # Which prompt prefixes each worker's cache holds, fed by the workers' KV events.
        self.indexes = {pool: PrefixIndex(self.block_size) for pool in POOLS}
        pools.on_removed.append(lambda ref: self.indexes[ref.pool].remove_worker(ref.index))

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Follow every token-producing worker (new ones are picked up as they appear)."""
        self._ready = True
        self._ensure_pollers()

    async def stop(self) -> None:
        self._ready = False
        tasks = list(self._pollers.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def is_ready(self) -> bool:
        if not self._ready:
            return False
        if self.colocated_mode:
            return bool(self.pools.routable("colocated"))
        return bool(self.pools.routable("prefill")) and bool(self.pools.routable("decode"))

    def server_info(self) -> ServerInfo:
        return ServerInfo(
            model=self.model_name,
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            num_prefill_workers=len(self.pools.routable("prefill")),
            num_decode_workers=len(self.pools.routable("decode")),
            num_colocated_workers=len(self.pools.routable("colocated")),
            max_in_flight=self.admission.max_in_flight,
            max_queue=self.admission.max_queue,
        )

    async def pool_stats(self) -> PoolStats:
        refs = [w for w in self.pools.all() if w.state in ("live", "draining")]
        loads = await asyncio.gather(
            *(w.handle.load.remote() for w in refs), return_exceptions=True
        )
        workers = [load for load in loads if not isinstance(load, BaseException)]
        return PoolStats(tuple(workers), self.admission.num_in_flight, self.admission.num_queued)

    # ---------------------------------------------------------------- token delivery
    def _ensure_pollers(self) -> None:
        for pool in ("decode", "colocated"):
            for ref in self.pools.workers[pool]:
                if ref.state in ("live", "draining") and ref not in self._pollers:
                    self._pollers[ref] = asyncio.ensure_future(self._poll(ref))

    async def _poll(self, ref: WorkerRef) -> None:
        """One remote call per batch of steps for all of a decode worker's requests."""
        try:
            while ref.state in ("live", "draining", "starting"):
                try:
                    batch = await ref.handle.next_tokens.remote()
                except RayActorError as exc:
                    self.pools.mark_dead(ref, f"{ref.worker_id} died: {exc}")
                    return
                self._apply_kv_events(ref, batch.kv_events)
                for update in batch.updates:
                    attempt = self._attempts.get(update.req_id)
                    if attempt is not None:
                        attempt.inbox.put(update)
        finally:
            self._pollers.pop(ref, None)

    def _apply_kv_events(self, ref: WorkerRef, batches: tuple[KVEvents, ...]) -> None:
        if ref.state in ("dead", "gone"):
            return  # late news from a worker that is no longer routed to
        for events in batches:
            self.indexes[ref.pool].apply(ref.index, events)

    def _on_worker_death(self, ref: WorkerRef, reason: str) -> None:
        for attempt in list(self._attempts.values()):
            if attempt.decode_ref is ref:
                attempt.inbox.put(WorkerLost(reason))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort_on(self, ref: WorkerRef, req_id: str) -> None:
        if ref.state in ("dead", "gone"):
            return
        try:
            await ref.handle.abort.remote(req_id)
        except RayActorError as exc:
            self.pools.mark_dead(ref, f"{ref.worker_id} died: {exc}")

    # ---------------------------------------------------------------- requests
    def _to_input(self, call: GenerateCall) -> GenerationInput:
        """Tokenize and validate once, here at the edge, and fix the seed."""
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
        sampling = call.sampling
        if sampling.seed is None:
            # Fixed here so prefill and decode (and a retry) draw from the same stream.
            sampling = replace(sampling, seed=uuid.uuid4().int >> 65)
        return GenerationInput(uuid.uuid4().hex, tuple(token_ids), sampling, call.priority)

    async def _call_worker(
        self,
        candidates: Callable[[], list[WorkerRef]],
        what: str,
        call: Callable[[WorkerRef], Awaitable[T]],
        *,
        hold: bool,
        route: Callable[[list[WorkerRef]], WorkerRef] | None = None,
    ) -> tuple[WorkerRef, T]:
        """Call the candidate `route` picks (default: the least loaded); a dead one is
        marked and the next tried.

        The worker counts the request as assigned from before the call, so concurrent
        arrivals spread; with `hold` the count stays until the caller gives it back.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.worker_wait_s
        while True:
            live = candidates()
            if not live:
                # Every candidate is gone for now (died, being replaced): wait for one
                # rather than fail the request at once.
                if loop.time() >= deadline:
                    raise WorkerLost(f"no {what} worker became available")
                await asyncio.sleep(WORKER_WAIT_POLL_S)
                continue
            ref = (
                route(live) if route is not None else min(live, key=lambda w: load_order(w.view()))
            )
            ref.num_assigned += 1
            try:
                result = await call(ref)
            except RayActorError as exc:
                ref.num_assigned -= 1
                self.pools.mark_dead(ref, f"{ref.worker_id} died: {exc}")
                continue
            except BaseException:
                ref.num_assigned -= 1
                raise
            if not hold:
                ref.num_assigned -= 1
            return ref, result

    async def generate(self, call: GenerateCall) -> AsyncIterator[TextChunk | FinalResult]:
        """Stream one request's chunks, then exactly one FinalResult."""
        if not self.is_ready():
            raise NotReadyError("pools are not ready")
        self._ensure_pollers()
        base = self._to_input(call)
        user_id = call.request_id or base.req_id  # what the client knows it by, for the log
        progress = _Progress(time.perf_counter())
        self.outputs.add(base.req_id, base.prompt_token_ids, base.sampling.stop)
        attempt: _Attempt | None = None
        finished = False
        run = self._run_colocated if self.colocated_mode else self._run_disaggregated
        try:
            async with self.admission.slot(priority=base.priority):
                for number in range(self.config.max_attempts):
                    attempt = self._begin(base, number)
                    try:
                        async for chunk in run(attempt, progress, base.req_id):
                            yield chunk
                        finished = True
                        yield self._final(user_id, base, progress, progress.finish_reason)
                        return
                    except WorkerLost as exc:
                        self._end(attempt)
                        if progress.num_out > 0:
                            raise RuntimeError(f"{exc} after tokens were sent") from exc
                        log.warning("request %s: %s; retrying on other workers", user_id, exc)
                        await asyncio.sleep(self.config.retry_delay_s * number)
                raise RuntimeError(f"gave up after {self.config.max_attempts} attempts")
        except (QueueFullError, NotReadyError) as exc:
            finished = True  # refused at the door: nothing to abort, not a cancellation
            log.info("request %s refused: %s", user_id, exc)
            raise
        except Exception as exc:  # noqa: BLE001 - becomes this request's terminal message
            log.error("request %s failed: %s", user_id, exc)
            finished = True
            if attempt is not None:
                self._end(attempt)
            yield self._final(user_id, base, progress, FinishReason.ERROR, str(exc))
        finally:
            if attempt is not None:
                self._end(attempt, abort=not finished)
            self.outputs.remove(base.req_id)
            if not finished:
                log.info("request %s cancelled after %d tokens", user_id, progress.num_out)

    def _begin(self, base: GenerationInput, number: int) -> _Attempt:
        req_id = base.req_id if number == 0 else f"{base.req_id}-{number}"
        attempt = _Attempt(replace(base, req_id=req_id))
        self._attempts[req_id] = attempt
        return attempt

    def _end(self, attempt: _Attempt, abort: bool = True) -> None:
        """Forget an attempt; abort it wherever it may still live (in the background:
        this may run while the generator closes on cancellation)."""
        if self._attempts.pop(attempt.req_id, None) is None:
            return
        if attempt.decode_ref is not None:
            attempt.decode_ref.num_assigned -= 1
        if not abort:
            return
        pools = ["colocated"] if self.colocated_mode else ["prefill", "decode"]
        known = [r for r in (attempt.prefill_ref, attempt.decode_ref) if r is not None]
        targets = (
            known if len(known) == len(pools) else [w for p in pools for w in self.pools.workers[p]]
        )
        for ref in targets:
            self._spawn(self._abort_on(ref, attempt.req_id))

    # ---------------------------------------------------------------- the two paths
    def _route(self, pool: str, hashes: list[int]) -> Callable[[list[WorkerRef]], WorkerRef]:
        """The routing policy over a pool's candidates, for a prompt with these hashes."""
        index = self.indexes[pool]

        def pick(live: list[WorkerRef]) -> WorkerRef:
            by_index = {w.index: w for w in live}
            choice = choose_worker([w.view() for w in live], index, hashes, self.config.routing)
            assert choice is not None  # live is not empty
            return by_index[choice.index]

        return pick

    async def _run_colocated(
        self, attempt: _Attempt, progress: _Progress, out_id: str
    ) -> AsyncIterator[TextChunk]:
        def submit(ref: WorkerRef) -> Any:
            attempt.decode_ref = ref  # before submit: tokens may come back at once
            return ref.handle.submit.remote(attempt.inp)

        hashes = self.indexes["colocated"].hash_prompt(attempt.inp.prompt_token_ids)
        await self._call_worker(
            lambda: self.pools.routable("colocated"),
            "colocated",
            submit,
            hold=True,
            route=self._route("colocated", hashes),
        )
        progress.timings = PhaseTimings(queued_s=time.perf_counter() - progress.arrival)
        progress.t_decoding = time.perf_counter()
        async for chunk in self._stream(attempt, progress, out_id, (), None):
            yield chunk

    async def _run_disaggregated(
        self, attempt: _Attempt, progress: _Progress, out_id: str
    ) -> AsyncIterator[TextChunk]:
        hashes = self.indexes["prefill"].hash_prompt(attempt.inp.prompt_token_ids)
        reservation = await self._reserve_or_submit(attempt, hashes)
        decode_ref = attempt.decode_ref
        assert decode_ref is not None
        queued_s = time.perf_counter() - progress.arrival
        if reservation is None:
            # Local path: the decode worker runs the prompt itself; no hand-off.
            metrics.prefill_path("local")
            progress.timings = PhaseTimings(queued_s, local_prefill=True)
            progress.t_decoding = time.perf_counter()
            async for chunk in self._stream(attempt, progress, out_id, (), None):
                yield chunk
            return
        metrics.prefill_path("remote")

        def prefill(ref: WorkerRef) -> Any:
            attempt.prefill_ref = ref
            return ref.handle.prefill.remote(attempt.inp, reservation)

        def paired() -> list[WorkerRef]:
            return [w for w in self.pools.routable("prefill") if decode_ref.worker_id in w.peers]

        try:
            prefill_ref, result = await asyncio.wait_for(
                self._call_worker(
                    paired, "prefill", prefill, hold=False, route=self._route("prefill", hashes)
                ),
                self.config.prefill_timeout_s,
            )
        except TimeoutError as exc:
            raise RuntimeError(f"prefill took over {self.config.prefill_timeout_s:.0f}s") from exc
        assert isinstance(result, PrefillResult)
        self._apply_kv_events(prefill_ref, result.kv_events)
        progress.t_decoding = time.perf_counter()
        progress.num_cached = result.num_cached_tokens
        progress.timings = PhaseTimings(queued_s, result.prefill_s)
        if result.finish_reason is FinishReason.ERROR:
            metrics.kv_transfer_failed()
            raise WorkerLost(result.error)  # nothing reached the client yet: retry
        if result.finish_reason is FinishReason.ABORT:
            raise RuntimeError("prefill worker aborted the request")
        if result.transfer_bytes:
            metrics.observe_kv_transfer(result.transfer_bytes)
        if result.finish_reason is not None:  # the first token ended it: free the reservation
            self._spawn(self._abort_on(decode_ref, attempt.req_id))
        tokens = () if result.first_token is None else (result.first_token,)
        async for chunk in self._stream(attempt, progress, out_id, tokens, result.finish_reason):
            yield chunk

    async def _reserve_or_submit(self, attempt: _Attempt, hashes: list[int]) -> Reservation | None:
        """Pick a decode worker (queued in the router, not dropped, until one has room).

        Returns its reservation, or None when the prompt is short enough once the decode
        worker's own cache is counted (`local_prefill_max_tokens`): then the decode worker
        got the whole request and runs the prompt itself.
        """
        num_prompt = len(attempt.inp.prompt_token_ids)
        while True:

            def reserve_or_submit(ref: WorkerRef) -> Any:
                cached = self.indexes["decode"].num_cached_tokens(ref.index, hashes)
                if num_prompt - cached <= self.config.local_prefill_max_tokens:
                    attempt.decode_ref = ref  # before submit: tokens may come back at once
                    return ref.handle.submit.remote(attempt.inp)
                return ref.handle.reserve.remote(attempt.inp, self.config.lease_s)

            ref, reservation = await self._call_worker(
                lambda: self.pools.routable("decode"), "decode", reserve_or_submit, hold=True
            )
            if attempt.decode_ref is ref or reservation is not None:
                attempt.decode_ref = ref
                return reservation
            ref.num_assigned -= 1
            await asyncio.sleep(self.config.reserve_poll_s)

    async def _stream(
        self,
        attempt: _Attempt,
        progress: _Progress,
        out_id: str,
        tokens: tuple[int, ...],
        reason: FinishReason | None,
    ) -> AsyncIterator[TextChunk]:
        """Turn token updates into text chunks until the request finishes."""
        while True:
            out = self.outputs.process(out_id, tokens, reason)
            if out.chunk is not None:
                progress.num_out += len(out.chunk.token_ids)
                progress.t_first = progress.t_first or time.perf_counter()
                yield out.chunk
            if out.finish_reason is not None:
                if reason is None and attempt.decode_ref is not None:
                    # A stop string ended it here: the worker is still going.
                    self._spawn(self._abort_on(attempt.decode_ref, attempt.req_id))
                progress.finish_reason = out.finish_reason
                return
            try:
                item = await attempt.inbox.take(self.config.token_stall_timeout_s)
            except TimeoutError as exc:
                raise RuntimeError(
                    f"no token for {self.config.token_stall_timeout_s:.0f}s"
                ) from exc
            if isinstance(item, BaseException):
                raise item
            if item.kv_wire_s:
                progress.timings = replace(
                    progress.timings, kv_wire_s=item.kv_wire_s, kv_transfer_s=item.kv_handoff_s
                )
            if item.finish_reason is FinishReason.ERROR:
                raise WorkerLost(item.error or "the decode worker reported an error")
            tokens, reason = item.new_token_ids, item.finish_reason
            progress.num_cached = max(progress.num_cached, item.num_cached_tokens)

    def _final(
        self,
        user_id: str,
        base: GenerationInput,
        progress: _Progress,
        reason: FinishReason,
        error: str = "",
    ) -> FinalResult:
        end = time.perf_counter()
        timings = replace(
            progress.timings,
            decode_s=end - progress.t_decoding if progress.t_decoding else 0.0,
            time_to_first_token_s=(progress.t_first or end) - progress.arrival,
        )
        usage = Usage(len(base.prompt_token_ids), progress.num_out, progress.num_cached)
        result = FinalResult(reason, usage, timings, error)
        self._log(user_id, result)
        return result

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
