"""A request's events as the serving core emits them, and the one interface that observes
them. Tracing (router/observability/tracing.py), metrics
(router/observability/serving_metrics.py) and the planner's signals
(router/planner/signals.py) are `RequestObserver`s; the core names none of them.

A request's events, in order: `arrived`, `admitted`; for each attempt `attempt_started`,
`routed`, `prefilled` (a remote prompt), `lost` or not, `attempt_ended`; `first_token`
once; `migrated` when a lost attempt's next one is a migration; then exactly one of
`finished` (its stream ran to its end) and `ended` (anything else: a final message
with ABORT or ERROR, a refusal, the client leaving). Besides, the workers' reports:
`phases` (where a request's time went on a worker) and `decode_step`.

Observers only record, with one exception: tracing names the request's trace
(`ClientRequest.trace_id`, which the final message quotes) and gives each attempt's
input its trace context, so that the workers' spans join the attempt's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from engine.core.outputs import FinalResult
    from engine.wire import PhaseReport, PrefillResult, WorkerStats
    from router.serving.run.attempts import Attempt, ClientRequest, WorkerLost
    from router.serving.workers import WorkerRef


@dataclass(frozen=True)
class ColocatedRoute:
    """The colocated replica an attempt runs on, and the routing policy that chose it."""

    worker: str
    policy: str


@dataclass(frozen=True)
class DisaggregatedRoute:
    """An attempt's decode worker, where its prompt runs and why
    (router/routing/prefill_policy.py)."""

    decode_worker: str
    prefill_worker: str  # "" when the prompt runs on the decode worker
    path: str  # "local" or "remote"
    reason: str
    uncached_tokens: int  # on the prefill worker (0 for a local prompt)
    placed_tokens: int  # the prompt's uncached tokens where it runs
    prefill_work: bool  # the prefill pool's work (not a short prompt a decode worker takes)


Route = ColocatedRoute | DisaggregatedRoute


@dataclass(frozen=True)
class PrefillReply:
    """A prefill worker's answer for an attempt, with its load account as the reply came."""

    worker: WorkerRef
    result: PrefillResult
    num_uncached: int  # prompt tokens it had to compute
    busy_since: float  # when it last went from idle to busy (time.monotonic)
    was_idle: bool  # the prompt found it idle: its prefill time is its own


class RequestObserver(Protocol):
    def arrived(self, request: ClientRequest) -> None: ...
    def admitted(self, request: ClientRequest) -> None: ...
    def attempt_started(self, request: ClientRequest, attempt: Attempt) -> None: ...
    def routed(self, attempt: Attempt, route: Route) -> None: ...
    def prefilled(self, attempt: Attempt, reply: PrefillReply) -> None: ...
    def first_token(self, request: ClientRequest) -> None: ...
    def lost(self, request: ClientRequest, attempt: Attempt, lost: WorkerLost) -> None: ...
    def attempt_ended(self, attempt: Attempt) -> None: ...
    def migrated(self, source: WorkerRef, reason: str, num_requests: int) -> None:
        """Requests left `source` for another worker after tokens were streamed."""
        ...

    def finished(self, request: ClientRequest, result: FinalResult) -> None:
        """The request's stream ran to its end; `result` is its final message."""
        ...

    def ended(self, request: ClientRequest, result: FinalResult | None, outcome: str) -> None:
        """The request ended otherwise: with `result` (ABORT, ERROR), or with no final
        message (refused, cancelled: `outcome` says which)."""
        ...

    def phases(self, worker: WorkerRef, phases: PhaseReport) -> None: ...
    def decode_step(self, worker: WorkerRef, stats: WorkerStats, step_s: float) -> None: ...


class BaseObserver:
    """Records nothing; an observer overrides the events it records."""

    def arrived(self, request: ClientRequest) -> None:
        pass

    def admitted(self, request: ClientRequest) -> None:
        pass

    def attempt_started(self, request: ClientRequest, attempt: Attempt) -> None:
        pass

    def routed(self, attempt: Attempt, route: Route) -> None:
        pass

    def prefilled(self, attempt: Attempt, reply: PrefillReply) -> None:
        pass

    def first_token(self, request: ClientRequest) -> None:
        pass

    def lost(self, request: ClientRequest, attempt: Attempt, lost: WorkerLost) -> None:
        pass

    def attempt_ended(self, attempt: Attempt) -> None:
        pass

    def migrated(self, source: WorkerRef, reason: str, num_requests: int) -> None:
        pass

    def finished(self, request: ClientRequest, result: FinalResult) -> None:
        pass

    def ended(self, request: ClientRequest, result: FinalResult | None, outcome: str) -> None:
        pass

    def phases(self, worker: WorkerRef, phases: PhaseReport) -> None:
        pass

    def decode_step(self, worker: WorkerRef, stats: WorkerStats, step_s: float) -> None:
        pass


class Observers:
    """Every event to each observer in turn, in the order given."""

    def __init__(self, observers: Sequence[RequestObserver]) -> None:
        self.observers = tuple(observers)

    def arrived(self, request: ClientRequest) -> None:
        for o in self.observers:
            o.arrived(request)

    def admitted(self, request: ClientRequest) -> None:
        for o in self.observers:
            o.admitted(request)

    def attempt_started(self, request: ClientRequest, attempt: Attempt) -> None:
        for o in self.observers:
            o.attempt_started(request, attempt)

    def routed(self, attempt: Attempt, route: Route) -> None:
        for o in self.observers:
            o.routed(attempt, route)

    def prefilled(self, attempt: Attempt, reply: PrefillReply) -> None:
        for o in self.observers:
            o.prefilled(attempt, reply)

    def first_token(self, request: ClientRequest) -> None:
        for o in self.observers:
            o.first_token(request)

    def lost(self, request: ClientRequest, attempt: Attempt, lost: WorkerLost) -> None:
        for o in self.observers:
            o.lost(request, attempt, lost)

    def attempt_ended(self, attempt: Attempt) -> None:
        for o in self.observers:
            o.attempt_ended(attempt)

    def migrated(self, source: WorkerRef, reason: str, num_requests: int) -> None:
        for o in self.observers:
            o.migrated(source, reason, num_requests)

    def finished(self, request: ClientRequest, result: FinalResult) -> None:
        for o in self.observers:
            o.finished(request, result)

    def ended(self, request: ClientRequest, result: FinalResult | None, outcome: str) -> None:
        for o in self.observers:
            o.ended(request, result, outcome)

    def phases(self, worker: WorkerRef, phases: PhaseReport) -> None:
        for o in self.observers:
            o.phases(worker, phases)

    def decode_step(self, worker: WorkerRef, stats: WorkerStats, step_s: float) -> None:
        for o in self.observers:
            o.decode_step(worker, stats, step_s)
