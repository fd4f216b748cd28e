"""The gRPC edge's metrics: every Generate call observed as the client sees it.

`MetricsInterceptor` wraps the Generate handler; a `RequestObserver` per call records
the first token, the gaps between tokens (as sent), the final message's phase timings
and usage, and a non-OK status, into the process's `RouterMetrics`.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from bisect import bisect_left
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from prometheus_client import Histogram

from pdserve.v1 import generation_pb2 as pb
from router.observability.metrics import RouterMetrics

GENERATE_METHOD = "/pdserve.v1.GenerationService/Generate"


def observe_repeated(histogram: Histogram, value: float, count: int) -> None:
    """`count` observations of one value, as one update of its bucket and sum: a message of
    N tokens costs one update, not N (prometheus_client's `observe` takes no weight; its
    Histogram keeps each bucket and the sum as counters, `_buckets` and `_sum`)."""
    buckets = getattr(histogram, "_buckets", None)
    bounds = getattr(histogram, "_upper_bounds", None)
    if buckets is None or bounds is None:  # not a plain child histogram: one at a time
        for _ in range(count):
            histogram.observe(value)
        return
    if count > 0:
        histogram._sum.inc(value * count)
        buckets[bisect_left(bounds, value)].inc(count)  # the first bound >= value, as observe


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
        observe_repeated(self._m.itl, gap, num_gaps)
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
            observer = RequestObserver(metrics)
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
