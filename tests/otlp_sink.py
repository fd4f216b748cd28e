"""An OTLP/gRPC trace receiver in this process, as a tracing collector would be: the
`TraceService` of the `opentelemetry-proto` definitions on a loopback port, keeping
every span it is sent, for tests that assert on the spans a service exports. (The protos
are imported when a receiver starts, so test modules that use one still import where
OpenTelemetry is not installed.)"""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc

from bench.harness.ports import free_port


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as it arrived: ids in hex ("" for a root span's parent)."""

    service: str  # the sender's resource `service.name`
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    start_ns: int
    end_ns: int
    kind: int  # Span.SpanKind: 1 internal, 2 server, 3 client
    status_code: int  # 0 unset, 1 ok, 2 error
    attributes: dict[str, Any] = field(default_factory=dict)
    events: tuple[str, ...] = ()

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


def _value(any_value: Any) -> Any:
    which = any_value.WhichOneof("value")
    return getattr(any_value, which) if which else None


def _attributes(key_values: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in key_values}


class _TraceService:
    """The TraceService's one method (`ExportTraceServiceRequest` in, an empty response
    out)."""

    def __init__(self, sink: OTLPSink, response: type) -> None:
        self.sink = sink
        self.response = response

    def Export(self, request: Any, context: Any) -> Any:
        received = []
        for resource_spans in request.resource_spans:
            service = str(_attributes(resource_spans.resource.attributes).get("service.name"))
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(
                        ReceivedSpan(
                            service=service,
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            start_ns=span.start_time_unix_nano,
                            end_ns=span.end_time_unix_nano,
                            kind=span.kind,
                            status_code=span.status.code,
                            attributes=_attributes(span.attributes),
                            events=tuple(e.name for e in span.events),
                        )
                    )
        self.sink.add(received)
        return self.response()


class OTLPSink:
    """`with OTLPSink() as sink:` listens on `sink.endpoint` (127.0.0.1:PORT)."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1 import (
            trace_service_pb2,
            trace_service_pb2_grpc,
        )

        self.port = free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self._spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        service = _TraceService(self, trace_service_pb2.ExportTraceServiceResponse)
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(service, self._server)
        self._server.add_insecure_port(self.endpoint)

    def add(self, spans: list[ReceivedSpan]) -> None:
        with self._lock:
            self._spans += spans

    @property
    def spans(self) -> list[ReceivedSpan]:
        """Every span received so far, in arrival order."""
        with self._lock:
            return list(self._spans)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        """The spans received of one trace."""
        return [s for s in self.spans if s.trace_id == trace_id]

    def __enter__(self) -> OTLPSink:
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(grace=None)
