"""Prometheus metrics of the router: their definitions, served at /metrics on their own
HTTP port.

Two sources, one endpoint:
* `router.observability.metrics_edge.MetricsInterceptor` observes every Generate call at the gRPC
  edge: each chunk as sent, the final message with its phase timings and usage, the
  status code;
* `router.observability.metrics_pools.PoolCollector` reads every worker's numbers at scrape time
  through the same `pool_stats()` path as GetPoolStats, so workers need no scrape
  target of their own.

Router code that sees events the edge cannot (KV transfer bytes and failures, worker
restarts) reports them with the module-level functions at the bottom.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    start_http_server,
)

from engine.wire import POOLS
from router.observability.metrics_pools import PoolCollector

log = logging.getLogger(__name__)

DEFAULT_METRICS_PORT = 9400

# The *_created series double every counter's output and no dashboard reads them.
disable_created_metrics()

# Latency buckets (seconds) from 1 ms to 10 min: CPU runs and large GPU batches alike.
_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
)  # fmt: skip
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


class RouterMetrics:
    """Every pdserve metric, in a registry of its own (one per router process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._request_histograms(self.registry)
        self._counters(self.registry)
        # Series that exist from the start, so rate() and dashboards see zeros, not gaps.
        for reason in ("stop", "length", "abort", "error"):
            self.requests.labels(finish_reason=reason)
        for pool in POOLS:
            self.worker_restarts.labels(pool=pool)
        for path, reason in PREFILL_PATH_SERIES:
            self.prefill_paths.labels(path=path, reason=reason)
        self.pools = PoolCollector()
        self.registry.register(self.pools)

    def _request_histograms(self, r: CollectorRegistry) -> None:
        self.ttft = Histogram(
            "pdserve_time_to_first_token_seconds",
            "Time from receiving a Generate call to sending its first token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "pdserve_inter_token_latency_seconds",
            "Time between two output tokens of one request, as sent to the client.",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "pdserve_e2e_request_latency_seconds",
            "Time from receiving a Generate call to its final message.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "pdserve_request_queue_time_seconds",
            "Time a request waited for admission and a decode reservation.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prefill_time = Histogram(
            "pdserve_request_prefill_time_seconds",
            "Time a request spent in prefill.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.kv_transfer_time = Histogram(
            "pdserve_kv_transfer_seconds",
            "Time of one request's KV hand-off from prefill to decode.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Histogram(
            "pdserve_request_prompt_tokens",
            "Prompt length of finished requests.",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.generation_tokens = Histogram(
            "pdserve_request_generation_tokens",
            "Output length of finished requests.",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )

    def _counters(self, r: CollectorRegistry) -> None:
        self.requests = Counter(
            "pdserve_requests",
            "Requests that ended with a final message, by finish reason.",
            ["finish_reason"],
            registry=r,
        )
        self.errors = Counter(
            "pdserve_request_errors",
            "Generate calls that ended with a non-OK gRPC status, by status code.",
            ["code"],
            registry=r,
        )
        self.prompt_tokens_total = Counter(
            "pdserve_prompt_tokens", "Prompt tokens of finished requests.", registry=r
        )
        self.generation_tokens_total = Counter(
            "pdserve_generation_tokens", "Tokens generated for finished requests.", registry=r
        )
        self.kv_transfer_bytes = Counter(
            "pdserve_kv_transfer_bytes",
            "Bytes of KV cache handed from prefill to decode.",
            registry=r,
        )
        self.kv_transfer_failures = Counter(
            "pdserve_kv_transfer_failures", "KV hand-offs that failed.", registry=r
        )
        self.prefill_paths = Counter(
            "pdserve_prefill_path",
            "Requests by where their prompt ran: remote (prefill pool, KV hand-off) or "
            "local (the decode worker itself), and why.",
            ["path", "reason"],
            registry=r,
        )
        self.worker_restarts = Counter(
            "pdserve_worker_restarts",
            "Workers restarted after dying, by pool.",
            ["pool"],
            registry=r,
        )

    def serve(self, host: str, port: int) -> Callable[[], None]:
        """Serve /metrics on host:port in a daemon thread; returns a function that stops it."""
        try:
            server, thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise OSError(f"cannot bind metrics server to {host}:{port}: {exc}") from exc
        log.info("metrics at http://%s:%d/metrics", host, port)

        def stop() -> None:
            server.shutdown()
            server.server_close()
            thread.join(timeout=5)

        return stop


# The decisions a deployment makes every day, present from the start.
PREFILL_PATH_SERIES = (
    ("local", "short_prompt"),
    ("local", "prefill_saturated"),
    ("local", "no_prefill_worker"),
    ("local", "prefill_failed"),
    ("remote", "prefill_within_slo"),
    ("remote", "local_prefill_off"),
    ("remote", "no_estimate"),
    ("remote", "decode_at_tpot_slo"),
    ("remote", "decode_past_ttft_slo"),
    ("remote", "decode_kv_pressure"),
    ("remote", "remote_sooner"),
)


_default: RouterMetrics | None = None
_default_lock = threading.Lock()


def get_metrics() -> RouterMetrics:
    """This process's metrics (created on first use)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = RouterMetrics()
        return _default


def observe_kv_transfer(num_bytes: int) -> None:
    """A KV hand-off of `num_bytes` completed (its duration comes from PhaseTimings)."""
    get_metrics().kv_transfer_bytes.inc(num_bytes)


def kv_transfer_failed() -> None:
    """A KV hand-off failed (the request was retried or ended with an error)."""
    get_metrics().kv_transfer_failures.inc()


def prefill_path(path: str, reason: str) -> None:
    """A disaggregated request's prompt ran on the prefill pool ("remote") or on its
    decode worker ("local"), for `reason` (router/routing/prefill_policy.py names them)."""
    get_metrics().prefill_paths.labels(path=path, reason=reason).inc()


def worker_restarted(pool: str) -> None:
    """A worker of `pool` ("prefill", "decode", "colocated") was restarted."""
    get_metrics().worker_restarts.labels(pool=pool).inc()
