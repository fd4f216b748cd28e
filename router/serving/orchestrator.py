"""The router's serving core: drives each request through its phases on the live pools.

State machine per request (docs/architecture.md): RECEIVED → VALIDATED → QUEUED →
DECODE_RESERVED → PREFILLING → TRANSFERRING → DECODING → FINISHED. Each attempt has its
own internal id. When an attempt is lost (a worker died, a hand-off was refused or
broke, the prefill worker failed), the next one continues the request: before any token
reached the client it starts over on other workers; after, it resumes from the prompt
plus every token already streamed (sampling is a function of seed and position, so the
continuation is the same text). Whatever ends an attempt, it is aborted on every worker
it touched; aborts are idempotent there.

This file: the core's parts, made once and wired to the pools, and its public face (the
edge's `Generator`, the admin API's policy, the planner's signals). One request runs in
a `RequestRun` (router/serving/run/request_run.py); its events go to the core's observers
(router/serving/events.py): tracing, metrics and the planner's signals. The rest of the
serving core is described in docs/architecture.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Any

from engine.core.outputs import FinalResult, TextChunk
from engine.core.validation import validate_prompt
from engine.frontend.output_processor import OutputProcessor
from engine.frontend.prompt import encode_prompt
from engine.wire import POOLS, GenerationInput, PoolName
from router.observability.serving_metrics import ServingMetrics
from router.observability.tracing import RequestTracing
from router.planner.signals import ServingSignals, SignalsObserver
from router.routing.kv_index import PrefixIndex
from router.routing.prefill_policy import PrefillPolicyConfig
from router.serving.admission import Admission, AdmissionControl
from router.serving.config import RouterConfig
from router.serving.delivery import TokenDelivery
from router.serving.errors import NotReadyError
from router.serving.events import Observers, RequestObserver
from router.serving.lease_renewal import LeaseRenewer
from router.serving.live_migration import LiveMigrator
from router.serving.protocol import GenerateCall, PoolStats, ServerInfo
from router.serving.run.attempts import ClientRequest, Progress
from router.serving.run.in_flight import PAIRED_POOLS, InFlight
from router.serving.run.paths import ColocatedPath, DisaggregatedPath
from router.serving.run.request_run import RequestRun, ServingParts
from router.serving.run.resume import Resumer
from router.serving.run.streaming import ChunkStream
from router.serving.run.worker_calls import WorkerCalls
from router.serving.run.worker_choice import WorkerChoice
from router.serving.workers import Pools

log = logging.getLogger(__name__)


class DisaggregatedGenerator:
    """Implements router.serving.protocol.Generator over the live pools."""

    def __init__(
        self,
        pools: Pools,
        tokenizer: Any,
        config: RouterConfig | None = None,
        admission: AdmissionControl | None = None,  # a router tier's shared budget
        observers: Sequence[RequestObserver] | None = None,
    ) -> None:
        """`observers` hear every request's events besides the planner's signals (None:
        tracing and metrics)."""
        self.pools = pools
        self.colocated_mode = pools.targets[PoolName.COLOCATED] > 0
        self.tokenizer = tokenizer
        self.config = config = config or RouterConfig()
        self.prefill_policy: PrefillPolicyConfig = config.prefill_policy
        self.admission: AdmissionControl = admission or Admission(
            config.max_in_flight,
            config.max_queue,
            policy=config.admission_policy,
            aging_s=config.priority_aging_s,
        )
        # What the planner reads: traffic, first tokens, worker speeds (cheap when unread).
        self.signals = ServingSignals()
        if observers is None:
            observers = (RequestTracing(), ServingMetrics())
        self.observer = Observers((*observers, SignalsObserver(self.signals)))
        self._ready = False
        self._shutting_down = False
        self._limits_from(pools)
        self.calls = WorkerCalls(pools)
        self.leases = LeaseRenewer(pools, config.lease_s, self.calls.spawn)
        self.in_flight = InFlight(
            pools, self.calls, self.leases, self.observer, self.colocated_mode
        )
        pools.on_death.append(self.in_flight.on_worker_death)
        # Which prompt prefixes each worker's cache holds, fed by the workers' KV events.
        self.indexes = {pool: PrefixIndex(self.block_size) for pool in POOLS}
        pools.on_removed.append(lambda ref: self.indexes[ref.pool].remove_worker(ref.index))
        self.delivery = TokenDelivery(
            pools, self.indexes, self.in_flight.inbox_of, self.observer, self.in_flight
        )
        # A worker that goes live (a replacement, a scale-up) is followed at once: a
        # request waiting for it is submitted there with no other traffic due.
        pools.on_live.append(self.delivery.follow)
        self.live_migration = (
            None
            if self.colocated_mode
            else LiveMigrator(pools, self.in_flight.by_id, config, self.calls.spawn, self.observer)
        )
        self.parts = self._parts()

    def _limits_from(self, pools: Pools) -> None:
        """The request limits every worker can serve (the smallest of each)."""
        info = pools.reference
        if info is None:
            raise ValueError("no workers")
        infos = [w.info for w in pools.all()]
        self.max_model_len = min(i.max_model_len for i in infos)
        self.vocab_size = min(i.vocab_size for i in infos)
        self.block_size = info.layout.block_size
        self.max_cache_tokens = min(i.num_blocks for i in infos) * self.block_size
        self.model_name = info.model_name

    def _parts(self) -> ServingParts:
        config = self.config
        choice = WorkerChoice(
            self.pools, self.indexes, config, self.block_size, lambda: self.prefill_policy
        )
        path: ColocatedPath | DisaggregatedPath
        if self.colocated_mode:
            path = ColocatedPath(choice, self.calls, self.observer)
        else:
            path = DisaggregatedPath(
                choice, self.calls, self.delivery, self.leases, self.observer, config
            )
        streamer = ChunkStream(config, self.calls, self.leases, self.in_flight, self.observer)
        return ServingParts(
            intake=self._intake,
            admission=self.admission,
            attempts=self.in_flight,
            path=path,
            streamer=streamer,
            delivery=self.delivery,
            observer=self.observer,
            config=config,
            shutting_down=lambda: self._shutting_down,
            resumer=Resumer(
                self.pools, self.in_flight, self.calls, self.leases, streamer, self.observer
            ),
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

    # ---------------------------------------------------------------- requests
    def generate(self, call: GenerateCall) -> AsyncIterator[TextChunk | FinalResult]:
        """Stream one request's chunks, then exactly one FinalResult. Nothing runs until
        the first iteration, which raises NotReadyError, ValueError (the prompt) or
        QueueFullError when the request is not taken."""
        return RequestRun(call, self.parts).outputs()

    def _intake(self, call: GenerateCall) -> ClientRequest:
        """The request as the core runs it: tokenized and validated once, here at the
        edge, with its seed fixed."""
        if not self.is_ready():
            raise NotReadyError("pools are not ready")
        self.delivery.ensure_pollers()
        base = self._to_input(call)
        output = OutputProcessor(self.tokenizer, base.prompt_token_ids, base.sampling.stop)
        return ClientRequest(
            call.request_id or base.req_id,  # what the client knows it by, for the log
            base,
            Progress(time.perf_counter(), output),
            call.trace_parent,
        )

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
        sampling = call.sampling
        if sampling.seed is None:
            # Fixed here so prefill and decode (and a retry) draw from the same stream.
            sampling = replace(sampling, seed=uuid.uuid4().int >> 65)
        return GenerationInput(
            uuid.uuid4().hex,
            tuple(token_ids),
            sampling,
            call.priority,
            request_id=call.request_id,  # a router tier's resumed stream finds it by this
        )
