"""Worker numbers for /metrics, read at scrape time through the pools' own stats call.

Per-worker gauges (running, waiting, KV cache usage) and per-pool counters (prefix-cache
queries and hits, preemptions) that survive a worker's restart.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.wire import POOLS, WorkerStats
from router.serving.protocol import PoolStats

log = logging.getLogger(__name__)

# Per-worker counters from WorkerStats, summed per pool: (metric, help, field).
_POOL_COUNTERS = (
    (
        "pdserve_prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache, by pool.",
        "prefix_query_tokens",
    ),
    (
        "pdserve_prefix_cache_hits",
        "Prompt tokens found in the prefix cache, by pool.",
        "prefix_hit_tokens",
    ),
    ("pdserve_preemptions", "Requests preempted to free KV blocks, by pool.", "num_preemptions"),
    (
        "pdserve_spec_decode_draft_tokens",
        "Proposals verified by speculative decoding, by pool.",
        "spec_draft_tokens",
    ),
    (
        "pdserve_spec_decode_accepted_tokens",
        "Proposals of speculative decoding the target accepted, by pool.",
        "spec_accepted_tokens",
    ),
)


class PoolCollector(Collector):
    """Reads pool stats at scrape time; per-worker gauges, per-pool monotonic counters.

    Workers count from zero when they restart, so counters here add each worker's
    increase since the previous scrape (a drop means a new incarnation: its count is new).
    """

    def __init__(self, timeout_s: float = 5.0) -> None:
        self.timeout_s = timeout_s
        self._source: Callable[[], PoolStats | None] | None = None
        self._lock = threading.Lock()
        self._last: dict[tuple[str, int, str], int] = {}
        self._totals: dict[tuple[str, str], float] = {}

    def set_source(self, source: Callable[[], PoolStats | None] | None) -> None:
        """`source()` returns the current PoolStats, or None while there are none."""
        self._source = source

    def _read(self) -> PoolStats | None:
        if self._source is None:
            return None
        try:
            return self._source()
        except Exception as exc:  # noqa: BLE001 - a scrape must not fail with the pools
            log.debug("pool stats unavailable for metrics: %r", exc)
            return None

    def _accumulate(self, workers: Iterable[WorkerStats]) -> None:
        for w in workers:
            for _, _, field in _POOL_COUNTERS:
                value = int(getattr(w, field))
                key = (w.pool, w.index, field)
                last = self._last.get(key, 0)
                increase = value - last if value >= last else value
                self._totals[(w.pool, field)] = self._totals.get((w.pool, field), 0) + increase
                self._last[key] = value

    def collect(self) -> Iterator[Metric]:
        """Called by prometheus_client for every scrape."""
        stats = self._read()
        with self._lock:
            workers = stats.workers if stats is not None else ()
            self._accumulate(workers)
            for name, doc, field in _POOL_COUNTERS:
                family = CounterMetricFamily(name, doc, labels=["pool"])
                for pool in POOLS:
                    if (pool, field) in self._totals:
                        family.add_metric([pool], self._totals[(pool, field)])
                yield family
        running = GaugeMetricFamily(
            "pdserve_num_requests_running",
            "Requests in a worker's running batch.",
            labels=["pool", "worker"],
        )
        waiting = GaugeMetricFamily(
            "pdserve_num_requests_waiting",
            "Requests waiting in a worker's scheduler queue.",
            labels=["pool", "worker"],
        )
        usage = GaugeMetricFamily(
            "pdserve_kv_cache_usage_ratio",
            "Fraction of a worker's KV blocks in use (0-1).",
            labels=["pool", "worker"],
        )
        for w in workers:
            labels = [w.pool, str(w.index)]
            running.add_metric(labels, w.num_running)
            waiting.add_metric(labels, w.num_waiting)
            usage.add_metric(labels, w.num_blocks_in_use / max(1, w.num_blocks_total))
        yield from (running, waiting, usage)
        yield GaugeMetricFamily(
            "pdserve_router_in_flight",
            "Requests admitted by the router and not finished.",
            value=stats.num_in_flight if stats is not None else 0,
        )
        yield GaugeMetricFamily(
            "pdserve_router_queued",
            "Requests waiting for admission at the router.",
            value=stats.num_queued if stats is not None else 0,
        )

    def describe(self) -> Iterator[Metric]:
        # Keeps registration from calling collect() (which would read the pools).
        return iter(())
