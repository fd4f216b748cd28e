"""One request's trace on the router: the spans the serving core records, and the
context it hands each attempt for the workers' spans.

A traced request's tree (router spans here, worker spans in engine/worker/phases.py):

    pdserve.v1.GenerationService/Generate   (SERVER; child of the client's traceparent)
    ├── router.admission                    (waiting for a slot in the router's queue)
    ├── router.attempt                      (one per attempt: a retry or a resume after a
    │   │                                    lost worker is the next one, with the reason)
    │   ├── router.route                    (the workers chosen, where the prompt runs, why)
    │   ├── router.prefill                  (CLIENT: the prefill call, as the router saw it)
    │   ├── prefill.queue / prefill.compute / kv.send         (prefill worker)
    │   └── kv.transfer ⊃ kv.receive, decode.admission, decode.first_step   (decode worker)
    │       (or decode.queue / decode.compute: a prompt run on its decode worker)
    └── router.stream                       (first token to the final message)

The spans follow the serving core's events (router/serving/events.py) through
`RequestTracing`, one of the core's observers. Untraced requests (tracing off, or not
sampled) get `NO_TRACE`, whose methods do nothing, and are not kept.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from engine import tracing
from engine.core.outputs import FinalResult
from engine.core.request import FinishReason
from engine.wire import GenerationInput, PrefillResult
from router.serving.events import BaseObserver, ColocatedRoute, PrefillReply, Route

if TYPE_CHECKING:
    from router.serving.run.attempts import Attempt, ClientRequest, WorkerLost

GENERATE_SPAN = "pdserve.v1.GenerationService/Generate"
TRACE_HEADERS = ("traceparent", "tracestate")  # W3C trace context, as gRPC metadata


def trace_parent(metadata: Any) -> dict[str, str]:
    """The W3C trace-context entries of a call's gRPC metadata (keys are lower case)."""
    if not metadata:
        return {}
    return {key: value for key, value in metadata if key in TRACE_HEADERS}


class AttemptTrace:
    """One attempt's spans; this base records nothing (the request is not traced)."""

    def bind(self, inp: GenerationInput) -> GenerationInput:
        """The attempt's input, carrying the context its workers' spans join."""
        return inp

    def routed(self, **attributes: tracing.AttributeValue) -> None:
        """The routing decision was made (workers, path, reason as attributes)."""

    def prefilled(self, worker_id: str, result: PrefillResult) -> None:
        """The prefill worker answered."""

    def lost(self, reason: str, resumed: bool) -> None:
        """The attempt cannot go on; the next one continues the request."""

    def end(self) -> None:
        """The attempt is over (idempotent)."""


class RequestTrace:
    """A request's spans on the router; this base records nothing."""

    trace_id = ""  # 32 hex digits when traced

    def admitted(self) -> None:
        """The router's admission let the request in."""

    def attempt(self, number: int, num_resumed_tokens: int) -> AttemptTrace:
        """Start attempt `number` (resuming after that many streamed tokens)."""
        return NO_ATTEMPT

    def finish(
        self, result: FinalResult | None, first_token_at: float | None, outcome: str = ""
    ) -> None:
        """The request ended: with its final message, or (None) refused or cancelled, as
        `outcome` says. Idempotent: only the first call counts."""


NO_ATTEMPT = AttemptTrace()
NO_TRACE = RequestTrace()


# Which router process of a router tier serves the calls of this process (0: the fleet
# owner, or the only one): every request span says so (`pdserve.router_process`).
_router_process = 0


def set_router_process(index: int) -> None:
    global _router_process
    _router_process = index


def start_request(
    parent: Mapping[str, str], request_id: str, arrival: float, priority: int
) -> RequestTrace:
    """The trace of a request that arrived at `arrival` (time.perf_counter()), child of
    the client's context when it sent one; NO_TRACE when tracing is off or the sampler
    leaves it out."""
    if not tracing.enabled():
        return NO_TRACE
    span = tracing.start(
        GENERATE_SPAN,
        tracing.extract(parent),
        tracing.wall_ns_perf(arrival),
        {
            "rpc.system": "grpc",
            "rpc.service": "pdserve.v1.GenerationService",
            "rpc.method": "Generate",
            "pdserve.request_id": request_id,
            "pdserve.priority": priority,
            "pdserve.router_process": _router_process,
        },
        kind="SERVER",
    )
    if not span.is_recording():
        return NO_TRACE
    return _RecordedRequest(span, arrival)


class _RecordedAttempt(AttemptTrace):
    def __init__(self, span: Any) -> None:
        self._span = span
        self._started = time.perf_counter()
        self._routed_at: float | None = None
        self._ended = False

    def bind(self, inp: GenerationInput) -> GenerationInput:
        return replace(inp, trace_context=tracing.inject(self._span))

    def routed(self, **attributes: tracing.AttributeValue) -> None:
        self._routed_at = time.perf_counter()
        tracing.record(
            "router.route",
            tracing.context_of(self._span),
            tracing.wall_ns_perf(self._started),
            tracing.wall_ns_perf(self._routed_at),
            {f"pdserve.route.{key}": value for key, value in attributes.items()},
        )

    def prefilled(self, worker_id: str, result: PrefillResult) -> None:
        start = self._routed_at or self._started
        span = tracing.start(
            "router.prefill",
            tracing.context_of(self._span),
            tracing.wall_ns_perf(start),
            {
                "pdserve.worker": worker_id,
                "pdserve.cached_tokens": result.num_cached_tokens,
                "pdserve.kv.bytes": result.transfer_bytes,
                "pdserve.prefill_s": result.prefill_s,
            },
            kind="CLIENT",
        )
        if result.error:
            _fail(span, result.error)
        span.end()

    def lost(self, reason: str, resumed: bool) -> None:
        self._span.add_event("attempt lost", {"pdserve.reason": reason})
        self._span.set_attribute("pdserve.attempt.next", "resume" if resumed else "retry")
        _fail(self._span, reason)
        self.end()

    def end(self) -> None:
        if not self._ended:
            self._ended = True
            self._span.end()


class _RecordedRequest(RequestTrace):
    def __init__(self, span: Any, arrival: float) -> None:
        self._span = span
        self._arrival = arrival
        self._num_attempts = 0
        self._current: AttemptTrace = NO_ATTEMPT
        self._finished = False
        self.trace_id = tracing.trace_id_of(span)

    def admitted(self) -> None:
        tracing.record(
            "router.admission",
            tracing.context_of(self._span),
            tracing.wall_ns_perf(self._arrival),
            time.time_ns(),
        )

    def attempt(self, number: int, num_resumed_tokens: int) -> AttemptTrace:
        self._num_attempts += 1
        kind = "first" if number == 0 else "resume" if num_resumed_tokens else "retry"
        span = tracing.start(
            "router.attempt",
            tracing.context_of(self._span),
            time.time_ns(),
            {
                "pdserve.attempt": number,
                "pdserve.attempt.kind": kind,
                "pdserve.attempt.resumed_tokens": num_resumed_tokens,
            },
        )
        self._current = _RecordedAttempt(span)
        return self._current

    def finish(
        self, result: FinalResult | None, first_token_at: float | None, outcome: str = ""
    ) -> None:
        if self._finished:
            return
        self._finished = True
        self._current.end()  # the request's end is its last attempt's too
        span = self._span
        span.set_attribute("pdserve.attempts", self._num_attempts)
        if result is None:
            span.set_attribute("pdserve.outcome", outcome)
            _fail(span, outcome)
            span.end()
            return
        usage, timings = result.usage, result.timings
        span.set_attributes(
            {
                "pdserve.finish_reason": result.finish_reason.value,
                "pdserve.prompt_tokens": usage.prompt_tokens,
                "pdserve.completion_tokens": usage.completion_tokens,
                "pdserve.cached_prompt_tokens": usage.cached_prompt_tokens,
                "pdserve.ttft_s": timings.time_to_first_token_s,
                "pdserve.local_prefill": timings.local_prefill,
            }
        )
        if first_token_at is not None:
            tracing.record(
                "router.stream",
                tracing.context_of(span),
                tracing.wall_ns_perf(first_token_at),
                time.time_ns(),
                {"pdserve.completion_tokens": usage.completion_tokens},
            )
        if result.finish_reason is FinishReason.ERROR:
            _fail(span, result.error)
        span.end()


def _fail(span: Any, description: str) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.set_status(Status(StatusCode.ERROR, description))


class RequestTracing(BaseObserver):
    """The serving core's observer that records each traced request's spans; it also
    names the request's trace and gives each attempt's input its context."""

    def __init__(self) -> None:
        # Traced requests and attempts in flight (an untraced one is never kept).
        self._requests: dict[ClientRequest, RequestTrace] = {}
        self._attempts: dict[Attempt, AttemptTrace] = {}

    def arrived(self, request: ClientRequest) -> None:
        progress, base = request.progress, request.base
        trace = start_request(
            request.trace_parent, request.request_id, progress.arrival, base.priority
        )
        if trace is not NO_TRACE:
            self._requests[request] = trace
            request.trace_id = trace.trace_id

    def admitted(self, request: ClientRequest) -> None:
        trace = self._requests.get(request)
        if trace is not None:
            trace.admitted()

    def attempt_started(self, request: ClientRequest, attempt: Attempt) -> None:
        trace = self._requests.get(request)
        if trace is not None:
            attempt_trace = self._attempts[attempt] = trace.attempt(
                attempt.number, attempt.resumes_after
            )
            attempt.inp = attempt_trace.bind(attempt.inp)

    def routed(self, attempt: Attempt, route: Route) -> None:
        attempt_trace = self._attempts.get(attempt)
        if attempt_trace is None:
            return
        if isinstance(route, ColocatedRoute):
            attempt_trace.routed(worker=route.worker, policy=route.policy)
        else:
            attempt_trace.routed(
                decode_worker=route.decode_worker,
                prefill_worker=route.prefill_worker,
                path=route.path,
                reason=route.reason,
                uncached_tokens=route.uncached_tokens,
            )

    def prefilled(self, attempt: Attempt, reply: PrefillReply) -> None:
        attempt_trace = self._attempts.get(attempt)
        if attempt_trace is not None:
            attempt_trace.prefilled(reply.worker.worker_id, reply.result)

    def lost(self, request: ClientRequest, attempt: Attempt, lost: WorkerLost) -> None:
        attempt_trace = self._attempts.get(attempt)
        if attempt_trace is not None:
            attempt_trace.lost(str(lost), resumed=bool(request.progress.num_out))

    def attempt_ended(self, attempt: Attempt) -> None:
        attempt_trace = self._attempts.pop(attempt, None)
        if attempt_trace is not None:
            attempt_trace.end()

    def finished(self, request: ClientRequest, result: FinalResult) -> None:
        self.ended(request, result, "")

    def ended(self, request: ClientRequest, result: FinalResult | None, outcome: str) -> None:
        trace = self._requests.pop(request, None)
        if trace is not None:
            trace.finish(result, request.progress.t_first, outcome)
