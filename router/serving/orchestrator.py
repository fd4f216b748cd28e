"""The router's serving core: drives each request through its phases on the live pools.

State machine per request (docs/architecture.md): RECEIVED → VALIDATED → QUEUED →
DECODE_RESERVED → PREFILLING → TRANSFERRING → DECODING → FINISHED. Each attempt has its
own internal id. When an attempt is lost (a worker died, a hand-off was refused or
broke, the prefill worker failed), the next one continues the request: before any token
reached the client it starts over on other workers; after, it resumes from the prompt
plus every token already streamed (sampling is a function of seed and position, so the
continuation is the same text). Whatever ends an attempt, it is aborted on every worker
it touched; aborts are idempotent there.

This file: admission, attempts, streaming, leases renewed. The rest of the serving core
(docs/architecture.md): `attempts`, `migrations`, `live_migration`, `paths`, `placement`,
`delivery`, `clients`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from engine.core.outputs import FinalResult, TextChunk
from engine.core.request import FinishReason
from engine.core.validation import validate_prompt
from engine.frontend.output_processor import OutputProcessor
from engine.frontend.prompt import encode_prompt
from engine.wire import POOLS, GenerationInput, PoolName
from router.edge.streams import tokens_per_message
from router.fleet.clients import WorkerDied
from router.observability.tracing import NO_TRACE, RequestTrace, start_request
from router.planner.signals import ServingSignals
from router.routing.kv_index import PrefixIndex
from router.routing.prefill_policy import PrefillPolicyConfig
from router.routing.worker_load import WorkerLease
from router.serving.admission import Admission
from router.serving.attempts import Attempt, Progress, WorkerLost, continuation, final_result
from router.serving.config import RouterConfig
from router.serving.delivery import TokenDelivery
from router.serving.errors import NotReadyError, QueueFullError
from router.serving.inbox import Moved, UpdateInbox
from router.serving.lease_renewal import LeaseRenewer
from router.serving.live_migration import LiveMigrator
from router.serving.migrations import migrates, migrations_counter
from router.serving.paths import ServingPaths
from router.serving.protocol import GenerateCall, PoolStats, ServerInfo, server_abort
from router.serving.workers import Pools, WorkerRef

log = logging.getLogger(__name__)
WORKER_WAIT_POLL_S = 0.05
PAIRED_POOLS = (PoolName.PREFILL, PoolName.DECODE)
T = TypeVar("T")


class DisaggregatedGenerator(ServingPaths):
    """Implements router.serving.protocol.Generator over the live pools."""

    def __init__(self, pools: Pools, tokenizer: Any, config: RouterConfig | None = None) -> None:
        self.pools = pools
        self.colocated_mode = pools.targets[PoolName.COLOCATED] > 0
        self.tokenizer = tokenizer
        self.config = config or RouterConfig()
        self.prefill_policy: PrefillPolicyConfig = self.config.prefill_policy
        self.admission = Admission(
            self.config.max_in_flight,
            self.config.max_queue,
            policy=self.config.admission_policy,
            aging_s=self.config.priority_aging_s,
        )
        # What the planner reads: traffic, first tokens, worker speeds (cheap when unread).
        self.signals = ServingSignals()
        self._attempts: dict[str, Attempt] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self.leases = LeaseRenewer(pools, self.config.lease_s, self._spawn)
        self._renewing = self.leases.renewing  # reservations kept while their requests wait
        self._ready = False
        self._shutting_down = False
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
        inbox_of, attempts = self._inbox_of, self._attempts
        self.delivery = TokenDelivery(pools, self.indexes, inbox_of, self.signals, attempts)
        # A worker that goes live (a replacement, a scale-up) is followed at once: a
        # request waiting for it in `_pick` is submitted there with no other traffic due.
        pools.on_live.append(self.delivery.follow)
        migrations_counter()  # on /metrics from the start, at zero
        self.live_migration = (
            None if self.colocated_mode else LiveMigrator(pools, attempts, self.config, self._spawn)
        )

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Follow every token-producing worker (new ones are picked up as they appear)."""
        self._ready = True
        self.delivery.ensure_pollers()
        if not self.colocated_mode:
            self.leases.start()

    async def stop(self) -> None:
        self._ready = False
        self.leases.stop()
        await self.delivery.stop()

    def begin_shutdown(self) -> None:
        """The service is draining: a request whose worker is lost from now on ends with
        ABORT at once (there is nowhere to move it that will outlive the drain)."""
        self._shutting_down = True

    def is_ready(self) -> bool:
        if not self._ready:
            return False
        if self.colocated_mode:
            return bool(self.pools.routable(PoolName.COLOCATED))
        return all(self.pools.routable(pool) for pool in PAIRED_POOLS)

    def server_info(self) -> ServerInfo:
        return ServerInfo(
            model=self.model_name,
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            num_prefill_workers=len(self.pools.routable(PoolName.PREFILL)),
            num_decode_workers=len(self.pools.routable(PoolName.DECODE)),
            num_colocated_workers=len(self.pools.routable(PoolName.COLOCATED)),
            max_in_flight=self.admission.max_in_flight,
            max_queue=self.admission.max_queue,
        )

    async def pool_stats(self) -> PoolStats:
        refs = [w for w in self.pools.all() if w.state.serving]
        loads = await asyncio.gather(*(w.client.load() for w in refs), return_exceptions=True)
        workers = [load for load in loads if not isinstance(load, BaseException)]
        return PoolStats(tuple(workers), self.admission.num_in_flight, self.admission.num_queued)

    def set_prefill_policy(self, config: PrefillPolicyConfig) -> None:
        """Change the local-prefill thresholds while serving (the admin API)."""
        self.prefill_policy = config
        log.info("prefill policy now %s", config)

    # ---------------------------------------------------------------- plumbing
    def _inbox_of(self, req_id: str) -> UpdateInbox | None:
        attempt = self._attempts.get(req_id)
        return None if attempt is None else attempt.inbox

    def _on_worker_death(self, ref: WorkerRef, reason: str) -> None:
        for attempt in list(self._attempts.values()):
            if attempt.decode_ref is ref:
                attempt.inbox.put(WorkerLost(reason, worker=ref))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort_on(self, ref: WorkerRef, req_id: str) -> None:
        if ref.state.ended:
            return
        try:
            await ref.client.abort(req_id)
        except WorkerDied as exc:
            self.pools.mark_dead(ref, f"{ref.worker_id} died: {exc}")

    async def _pick(
        self,
        candidates: Callable[[], Sequence[WorkerRef]],
        what: str,
        route: Callable[[Sequence[WorkerRef]], WorkerRef],
    ) -> WorkerRef:
        """The worker `route` picks among the candidates, waiting (not failing) while a
        whole pool is down and being replaced."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.worker_wait_s
        while True:
            live = candidates()
            if live:
                return route(live)
            if loop.time() >= deadline:
                raise WorkerLost(f"no {what} worker became available")
            await asyncio.sleep(WORKER_WAIT_POLL_S)

    async def _call(self, ref: WorkerRef, pending: Awaitable[T]) -> T:
        """A worker call whose failure means the worker died: mark it, lose the attempt."""
        try:
            return await pending
        except WorkerDied as exc:
            self.pools.mark_dead(ref, f"{ref.worker_id} died: {exc}")
            raise WorkerLost(f"{ref.worker_id} died: {exc}", worker=ref) from exc

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

    async def generate(self, call: GenerateCall) -> AsyncIterator[TextChunk | FinalResult]:
        """Stream one request's chunks, then exactly one FinalResult."""
        if not self.is_ready():
            raise NotReadyError("pools are not ready")
        self.delivery.ensure_pollers()
        base = self._to_input(call)
        request_id = call.request_id or base.req_id  # what the client knows it by, for the log
        output = OutputProcessor(self.tokenizer, base.prompt_token_ids, base.sampling.stop)
        progress = Progress(time.perf_counter(), output)
        self.signals.request_arrived(progress)
        trace = start_request(call.trace_parent, request_id, progress.arrival, base.priority)
        attempt: Attempt | None = None
        finished = False
        run_locally = False
        num_failed = 0  # lost attempts other than migrations
        try:
            async with self.admission.slot(priority=base.priority):
                trace.admitted()
                for number in itertools.count():
                    attempt = self._begin(base, number, progress, trace, request_id)
                    try:
                        if self.colocated_mode:
                            chunks = self._run_colocated(attempt, progress)
                        else:
                            chunks = self._run_disaggregated(attempt, progress, run_locally)
                        async for chunk in chunks:
                            yield chunk
                        finished = True
                        self.signals.request_ended(
                            progress, progress.num_out, progress.tpot_s(), completed=True
                        )
                        yield final_result(
                            request_id, base, progress, progress.finish_reason, trace=trace
                        )
                        return
                    except WorkerLost as exc:
                        attempt.trace.lost(str(exc), resumed=bool(progress.num_out))
                        self._end(attempt)
                        if self._shutting_down:
                            finished = True
                            log.info("request %s ends with the service: %s", request_id, exc)
                            why = f"server shutting down: {exc}"
                            yield final_result(
                                request_id, base, progress, FinishReason.ABORT, why, trace
                            )
                            return
                        run_locally = exc.run_locally
                        if migrates(request_id, exc, progress, self.config.max_migrations):
                            continue  # straight on: the client is waiting mid-stream
                        num_failed += 1
                        if num_failed >= self.config.max_attempts:
                            raise RuntimeError(
                                f"gave up after {self.config.max_attempts} attempts: {exc}"
                            ) from exc
                        if progress.num_out:
                            progress.num_resumed += 1
                        log.warning(
                            "request %s: %s; %s",
                            request_id,
                            exc,
                            f"resuming after {progress.num_out} tokens"
                            if progress.num_out
                            else "retrying on other workers",
                        )
                        if not run_locally:
                            await asyncio.sleep(self.config.retry_delay_s * num_failed)
        except asyncio.CancelledError as exc:
            abort = server_abort(exc)
            if abort is None:
                raise  # the client cancelled or left: nobody to tell
            # The server ends the call (a drain past its grace): this request's one
            # terminal message says what it had (usage, timings), and it ends everywhere.
            finished = True
            if attempt is not None:
                self._end(attempt)
            yield final_result(request_id, base, progress, FinishReason.ABORT, abort.reason, trace)
        except (QueueFullError, NotReadyError) as exc:
            finished = True  # refused at the door: nothing to abort, not a cancellation
            log.info("request %s refused: %s", request_id, exc)
            trace.finish(None, None, f"refused: {exc}")
            raise
        except Exception as exc:  # noqa: BLE001 - becomes this request's terminal message
            log.error("request %s failed: %s", request_id, exc)
            finished = True
            if attempt is not None:
                self._end(attempt)
            yield final_result(request_id, base, progress, FinishReason.ERROR, str(exc), trace)
        finally:
            if attempt is not None:
                self._end(attempt, abort=not finished)
            self.signals.request_ended(progress, progress.num_out, None, completed=False)
            if not finished:
                traced = f" trace={trace.trace_id}" if trace.trace_id else ""
                log.info(
                    "request %s cancelled after %d tokens%s", request_id, progress.num_out, traced
                )
            trace.finish(None, progress.t_first, "cancelled")  # unless it finished

    def _begin(
        self,
        base: GenerationInput,
        number: int,
        progress: Progress,
        trace: RequestTrace = NO_TRACE,
        request_id: str = "",
    ) -> Attempt:
        # A worker that became live since the request arrived (a replacement, a scale-up)
        # may be where this attempt lands: follow it first.
        self.delivery.ensure_pollers()
        attempt_trace = trace.attempt(number, progress.num_out)
        inp = attempt_trace.bind(continuation(base, number, progress))
        attempt = Attempt(
            inp,
            request_id or base.req_id,
            trace=attempt_trace,
            resumes_after=progress.num_out,
        )
        self._attempts[attempt.req_id] = attempt
        return attempt

    def _end(self, attempt: Attempt, abort: bool = True) -> None:
        """Forget an attempt; abort it wherever it may still live (in the background:
        this may run while the generator closes on cancellation)."""
        if self._attempts.pop(attempt.req_id, None) is None:
            return
        attempt.trace.end()
        for lease in attempt.leases:
            lease.release()
        if attempt.decode_ref is not None:
            self._renewing[attempt.decode_ref].discard(attempt.req_id)
        if not abort:
            return
        pools = (PoolName.COLOCATED,) if self.colocated_mode else PAIRED_POOLS
        known = [r for r in (attempt.prefill_ref, attempt.decode_ref) if r is not None]
        targets = (
            known if len(known) == len(pools) else [w for w in self.pools.all() if w.pool in pools]
        )
        for ref in targets:
            self._spawn(self._abort_on(ref, attempt.req_id))

    # ---------------------------------------------------------------- the two paths
    async def _stream(
        self,
        attempt: Attempt,
        progress: Progress,
        tokens: tuple[int, ...],
        reason: FinishReason | None,
        local: WorkerLease | None = None,
    ) -> AsyncIterator[TextChunk]:
        """Turn token updates into text chunks until the request finishes."""
        while True:
            chunk, finish = progress.output.process(tokens, reason)
            if chunk is not None:
                progress.token_ids += chunk.token_ids
                if progress.t_first is None:
                    progress.t_first = time.perf_counter()
                    self.signals.first_token(progress, progress.t_first - progress.arrival)
                yield chunk
            if finish is not None:
                if reason is None and attempt.decode_ref is not None:
                    # A stop string ended it here: the worker is still going.
                    self._spawn(self._abort_on(attempt.decode_ref, attempt.req_id))
                progress.finish_reason = finish
                return
            wanted = tokens_per_message(self.config.stream_interval, len(self._attempts))
            stall_s = self.config.token_stall_timeout_s
            try:  # the first token alone, then a message's worth
                item = await attempt.inbox.take(stall_s, wanted if progress.t_first else 1)
            except TimeoutError as exc:
                raise RuntimeError(f"no token for {stall_s:.0f}s") from exc
            if attempt.decode_ref is not None:
                # The decode worker answered for the request: its reservation is used.
                self._renewing[attempt.decode_ref].discard(attempt.req_id)
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, Moved):
                # It moved with its KV (router/serving/live_migration.py): stream what the client
                # has not seen of the old attempt's tokens; the new attempt's follow.
                tokens = item.outputs[progress.num_out - item.first_index :]
                reason, local = None, None
                progress.num_moved += 1
                continue
            if item.kv_wire_s and not attempt.resumes_after:
                progress.timings = replace(
                    progress.timings, kv_wire_s=item.kv_wire_s, kv_transfer_s=item.kv_handoff_s
                )
            if item.finish_reason is FinishReason.ERROR:
                # A refused or broken hand-off, or an expired reservation: the decode pool
                # is up, so the next attempt runs there from what was streamed.
                error = item.error or "the decode worker reported an error"
                raise WorkerLost(error, run_locally=True)
            if local is not None and item.new_token_ids:
                local.done_with_tokens(item.phases.compute_s if item.phases else None)
            tokens, reason = item.new_token_ids, item.finish_reason
            progress.note_cached(attempt, item.num_cached_tokens)
