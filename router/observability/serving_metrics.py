"""The serving core's events as metrics: where prompts ran, KV hand-offs, migrations, and
the workers' phase reports (router/observability/phase_metrics.py). `ServingMetrics` is
one of the core's observers (router/serving/events.py).

Migrations are counted in `pdserve_request_migrations_total{pool, reason}` (reason:
`worker_died`; `drained_kv` for a request that moved off a draining decode worker with
its KV, router/serving/live_migration.py, and `drained` for one that could not and moved
by recompute; `rebalanced_kv` and `rebalanced` the same for a move an operator asked
for, `MigrateRequests`).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter

from engine.core.request import FinishReason
from router.observability import metrics, phase_metrics
from router.serving.events import BaseObserver, DisaggregatedRoute, PrefillReply, Route
from router.serving.run.migrations import MIGRATION_POOLS, MIGRATION_REASONS

if TYPE_CHECKING:
    from engine.wire import PhaseReport
    from router.serving.run.attempts import Attempt
    from router.serving.workers import WorkerRef

_counters: dict[int, Counter] = {}
_lock = threading.Lock()


def migrations_counter(registry: CollectorRegistry | None = None) -> Counter:
    """The migrations counter in `registry` (the router's own by default), registered on
    first use with every (pool, reason) series at zero."""
    registry = registry or metrics.get_metrics().registry
    with _lock:
        counter = _counters.get(id(registry))
        if counter is None:
            counter = Counter(
                "pdserve_request_migrations",
                "Requests moved to another worker after tokens were streamed, by the pool "
                "of the worker they left and why they left it.",
                ["pool", "reason"],
                registry=registry,
            )
            for pool in MIGRATION_POOLS:
                for reason in MIGRATION_REASONS:
                    counter.labels(pool=pool, reason=reason)
            _counters[id(registry)] = counter
        return counter


class ServingMetrics(BaseObserver):
    """Counts what the serving core's events say, on the router's registry."""

    def __init__(self) -> None:
        migrations_counter()  # on /metrics from the start, at zero

    def routed(self, attempt: Attempt, route: Route) -> None:
        if isinstance(route, DisaggregatedRoute):
            metrics.prefill_path(route.path, route.reason)

    def prefilled(self, attempt: Attempt, reply: PrefillReply) -> None:
        result = reply.result
        phase_metrics.observe(reply.worker.pool, reply.worker.index, result.phases)
        if result.finish_reason is FinishReason.ERROR:
            metrics.kv_transfer_failed()  # nothing was sent
        elif result.finish_reason is not FinishReason.ABORT and result.transfer_bytes:
            metrics.observe_kv_transfer(result.transfer_bytes)

    def migrated(self, source: WorkerRef, reason: str, num_requests: int) -> None:
        migrations_counter().labels(pool=source.pool, reason=reason).inc(num_requests)

    def phases(self, worker: WorkerRef, phases: PhaseReport) -> None:
        phase_metrics.observe(worker.pool, worker.index, phases)
