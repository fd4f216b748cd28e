"""Prometheus metrics of the router, served at /metrics on their own HTTP port.

Two sources, one endpoint:
* `MetricsInterceptor` observes every Generate call at the gRPC edge: each chunk as
  sent, the final message with its phase timings and usage, the status code;
* `PoolCollector` reads every worker's numbers at scrape time through the same
  `pool_stats()` path as GetPoolStats, so workers need no scrape target of their own.

Router code that sees events the edge cannot (KV transfer bytes and failures, worker
restarts) reports them with the module-level functions at the bottom.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Any

import grpc
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.core.outputs import WorkerStats
from engine.wire import POOLS
from pdserve.v1 import generation_pb2 as pb
from router.protocol import PoolStats

log = logging.getLogger(__name__)

DEFAULT_METRICS_PORT = 9400
GENERATE_METHOD = "/pdserve.v1.GenerationService/Generate"

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
        r = self.registry
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
        # Series that exist from the start, so rate() and dashboards see zeros, not gaps.
        for reason in ("stop", "length", "abort", "error"):
            self.requests.labels(finish_reason=reason)
        for pool in POOLS:
            self.worker_restarts.labels(pool=pool)
        for path, reason in PREFILL_PATH_SERIES:
            self.prefill_paths.labels(path=path, reason=reason)
        self.pools = PoolCollector()
        r.register(self.pools)

    def start_request(self) -> RequestObserver:
        """An observer for one Generate call, started now."""
        return RequestObserver(self)

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


class RequestObserver:
    """Records one Generate call: first token, gaps between tokens, final result, status."""

    def __init__(self, metrics: RouterMetrics) -> None:
        self._m = metrics
        self._start = time.perf_counter()
        self._last: float | None = None
        self._failed = False

    def on_tokens(self, num_tokens: int) -> None:
        """A chunk carrying `num_tokens` new tokens was sent to the client."""
        if num_tokens <= 0:
            return
        now = time.perf_counter()
        if self._last is None:
            self._m.ttft.observe(now - self._start)
            num_gaps, gap = num_tokens - 1, 0.0
        else:
            # Tokens sent together share the gap since the previous chunk.
            num_gaps, gap = num_tokens, (now - self._last) / num_tokens
        for _ in range(num_gaps):
            self._m.itl.observe(gap)
        self._last = now

    def on_response(self, response: pb.GenerateResponse) -> None:
        """A message of the stream was sent: a chunk, or the final one."""
        self.on_tokens(len(response.token_ids))
        if response.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            self.on_final(response)

    def on_final(self, response: pb.GenerateResponse) -> None:
        """The final message was sent."""
        m, t, u = self._m, response.timings, response.usage
        m.e2e.observe(time.perf_counter() - self._start)
        reason = pb.FinishReason.Name(response.finish_reason).removeprefix("FINISH_REASON_")
        m.requests.labels(finish_reason=reason.lower()).inc()
        m.queue_time.observe(t.queued_seconds)
        if t.prefill_seconds > 0:
            m.prefill_time.observe(t.prefill_seconds)
        if t.kv_transfer_seconds > 0:
            m.kv_transfer_time.observe(t.kv_transfer_seconds)
        m.prompt_tokens.observe(u.prompt_tokens)
        m.generation_tokens.observe(u.completion_tokens)
        m.prompt_tokens_total.inc(u.prompt_tokens)
        m.generation_tokens_total.inc(u.completion_tokens)

    def on_error(self, code: grpc.StatusCode) -> None:
        """The call ended with this non-OK status; counted once per call."""
        if not self._failed:
            self._failed = True
            self._m.errors.labels(code=code.name).inc()


class _ObservedContext:
    """A ServicerContext that shows the observer every message and abort on the way out."""

    def __init__(self, inner: grpc.aio.ServicerContext, observer: RequestObserver) -> None:
        self._inner = inner
        self._observer = observer

    async def write(self, message: Any) -> None:
        await self._inner.write(message)
        self._observer.on_response(message)

    async def abort(self, code: grpc.StatusCode, details: str = "", *args: Any) -> None:
        self._observer.on_error(code)
        await self._inner.abort(code, details, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class MetricsInterceptor(grpc.aio.ServerInterceptor):
    """Observes every Generate call at the edge; put it first, so it sees auth refusals too."""

    def __init__(self, metrics: RouterMetrics, method: str = GENERATE_METHOD) -> None:
        self._metrics = metrics
        self._method = method

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method != self._method:
            return handler
        behavior = handler.unary_stream
        metrics = self._metrics

        async def observed(request: Any, context: grpc.aio.ServicerContext) -> None:
            observer = metrics.start_request()
            wrapped = _ObservedContext(context, observer)
            try:
                if inspect.isasyncgenfunction(behavior):
                    async for response in behavior(request, wrapped):
                        await wrapped.write(response)
                else:
                    await behavior(request, wrapped)
            except asyncio.CancelledError:
                observer.on_error(grpc.StatusCode.CANCELLED)  # client gone or deadline
                raise
            except grpc.aio.AbortError:
                raise  # context.abort(): already counted by _ObservedContext
            except Exception:
                observer.on_error(grpc.StatusCode.UNKNOWN)
                raise

        return grpc.unary_stream_rpc_method_handler(
            observed, handler.request_deserializer, handler.response_serializer
        )


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
    ("remote", "decode_kv_pressure"),
    ("remote", "remote_sooner"),
)

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
    decode worker ("local"), for `reason` (router/prefill_policy.py names them)."""
    get_metrics().prefill_paths.labels(path=path, reason=reason).inc()


def worker_restarted(pool: str) -> None:
    """A worker of `pool` ("prefill", "decode", "colocated") was restarted."""
    get_metrics().worker_restarts.labels(pool=pool).inc()
