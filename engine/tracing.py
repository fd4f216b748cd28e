"""Distributed tracing: OpenTelemetry spans sent over OTLP/gRPC, off by default.

Every process of a deployment (the router and each worker) calls `configure()` once
with the same `TracingConfig`. Until then, and whenever tracing is off, `enabled()` is
False, nothing of OpenTelemetry is imported, and every hook costs one check. A request's
context crosses process boundaries as a W3C trace-context carrier (`traceparent`,
`tracestate`): a plain dict inside the wire types, filled only for requests the router
samples, so workers record spans exactly for the requests whose trace exists.

Spans are recorded after the fact with the times they began and ended (`record`): a
phase's end is known only when it is over (a token came out, the KV landed), and
nothing is held open on the hot path.
"""

from __future__ import annotations

import inspect
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

Carrier = dict[str, str]
AttributeValue = str | int | float | bool
# How long stopping a process may wait for its last spans to reach the collector: one
# that is down must not hold up a drain or a restart.
FLUSH_ON_SHUTDOWN_MS = 2000


@dataclass(frozen=True)
class TracingConfig:
    """Where spans go and which share of requests is traced."""

    otlp_endpoint: str = ""  # HOST:PORT of an OTLP/gRPC collector; "" = tracing off
    sample_ratio: float = 1.0  # of requests that arrive without a sampled parent

    def __post_init__(self) -> None:
        if not 0.0 <= self.sample_ratio <= 1.0:
            raise ValueError(f"sample_ratio must be in [0, 1], got {self.sample_ratio}")
        if self.otlp_endpoint:
            host, sep, port = self.otlp_endpoint.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"expected HOST:PORT, got {self.otlp_endpoint!r}")

    @property
    def enabled(self) -> bool:
        return bool(self.otlp_endpoint)


_TLS_VARIABLES = (
    "OTEL_EXPORTER_OTLP_CERTIFICATE",
    "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE",
    "OTEL_EXPORTER_OTLP_INSECURE",
    "OTEL_EXPORTER_OTLP_TRACES_INSECURE",
)


class _State:
    tracer: Any = None
    provider: Any = None
    processor: Any = None


_state = _State()


def enabled() -> bool:
    """True once this process traces (configure() with an endpoint, or install())."""
    return _state.tracer is not None


def configure(config: TracingConfig | None, service_name: str) -> None:
    """Export this process's spans to the config's collector (no-op when tracing is off).

    A request that arrives with a sampled parent is traced whatever the ratio; one
    without is traced with probability `sample_ratio` (decided by its trace id, so every
    process that sees it agrees)."""
    if config is None or not config.enabled or enabled():
        return
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # Plaintext, unless the standard OpenTelemetry variables ask for TLS (a CA
    # certificate, or OTEL_EXPORTER_OTLP_INSECURE=false); the other OTEL_EXPORTER_OTLP_*
    # and OTEL_BSP_* variables (headers, timeouts, batching) apply as usual.
    tls_asked = any(name in os.environ for name in _TLS_VARIABLES)
    exporter = OTLPSpanExporter(endpoint=config.otlp_endpoint, insecure=None if tls_asked else True)
    install(BatchSpanProcessor(exporter), service_name, config.sample_ratio)
    log.info(
        "tracing: spans to %s over OTLP/gRPC, %g of requests sampled",
        config.otlp_endpoint,
        config.sample_ratio,
    )


def install(processor: Any, service_name: str, sample_ratio: float = 1.0) -> None:
    """Trace through this span processor (tests pass one over an in-memory exporter)."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    provider = TracerProvider(
        resource=Resource.create({"service.name": service_name}),
        sampler=ParentBased(TraceIdRatioBased(sample_ratio)),
    )
    provider.add_span_processor(processor)
    _state.processor = processor
    # A provider of our own, not the global one: an application embedding pdserve keeps
    # its own tracing set-up.
    _state.provider = provider
    _state.tracer = provider.get_tracer("pdserve")


def shutdown() -> None:
    """Send the spans still buffered (for at most FLUSH_ON_SHUTDOWN_MS) and stop tracing
    in this process."""
    provider, processor = _state.provider, _state.processor
    _state.provider = _state.processor = _state.tracer = None
    if provider is None:
        return
    if "timeout_millis" in inspect.signature(processor.shutdown).parameters:
        processor.shutdown(timeout_millis=FLUSH_ON_SHUTDOWN_MS)
    provider.shutdown()


def tracer() -> Any:
    """The process's OpenTelemetry tracer; only call when enabled()."""
    return _state.tracer


# ---------------------------------------------------------------- contexts
def extract(carrier: Mapping[str, str]) -> Any:
    """The OpenTelemetry context a W3C carrier names (empty: a new trace)."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract(dict(carrier))


def inject(span: Any) -> Carrier:
    """The W3C carrier of `span`, for the wire types."""
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: Carrier = {}
    TraceContextTextMapPropagator().inject(carrier, trace.set_span_in_context(span))
    return carrier


def context_of(span: Any) -> Any:
    """The context whose parent is `span` (for a child span)."""
    from opentelemetry import trace

    return trace.set_span_in_context(span)


def trace_id_of(span: Any) -> str:
    """The span's trace id as 32 hex digits ("" when it is not recorded)."""
    context = span.get_span_context()
    return f"{context.trace_id:032x}" if span.is_recording() else ""


# ---------------------------------------------------------------- recording
def start(
    name: str,
    parent: Any,
    start_ns: int,
    attributes: Mapping[str, AttributeValue] | None = None,
    *,
    kind: str = "INTERNAL",
) -> Any:
    """Open a span that began at `start_ns` under `parent` (a context from extract() or
    context_of()); the caller ends it with `span.end(end_time=...)`."""
    from opentelemetry.trace import SpanKind

    return tracer().start_span(
        name,
        context=parent,
        kind=SpanKind[kind],
        start_time=start_ns,
        attributes=dict(attributes or {}),
    )


def record(
    name: str,
    parent: Any,
    start_ns: int,
    end_ns: int,
    attributes: Mapping[str, AttributeValue] | None = None,
) -> Any:
    """A span that already ended: began at start_ns, ended at end_ns (wall clock, ns)."""
    span = start(name, parent, start_ns, attributes)
    span.end(end_time=max(start_ns, end_ns))
    return span


def record_under(
    carrier: Mapping[str, str],
    name: str,
    start_ns: int,
    end_ns: int,
    attributes: Mapping[str, AttributeValue] | None = None,
) -> Any:
    """`record` under the span a carrier names; None when the request is not traced."""
    if not carrier or not enabled():
        return None
    return record(name, extract(carrier), start_ns, end_ns, attributes)


# ---------------------------------------------------------------- clocks
def wall_ns(monotonic_s: float) -> int:
    """A time.monotonic() reading as wall-clock nanoseconds (spans use the wall clock)."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


def wall_ns_perf(perf_s: float) -> int:
    """A time.perf_counter() reading as wall-clock nanoseconds."""
    return time.time_ns() - int((time.perf_counter() - perf_s) * 1e9)
