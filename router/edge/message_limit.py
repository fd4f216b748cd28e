"""The request message size limit, enforced by the router's own interceptor.

gRPC can refuse an oversized message itself (`grpc.max_receive_message_length`), but it
does so before any handler or interceptor sees the call, so such a refusal reaches no
metric. Here gRPC's own limit is a ceiling a few times higher (`ceiling_bytes`: nothing
larger is ever buffered), and this interceptor refuses every message over the configured
limit with what gRPC would have said (RESOURCE_EXHAUSTED, "Received message larger than
max (N vs. L)"), through the call's context, so the edge's metrics count it.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc

# gRPC's own limit, as a multiple of the configured one: the largest message read whole.
CEILING_FACTOR = 4


def ceiling_bytes(max_message_bytes: int) -> int:
    """gRPC's receive limit for a configured limit: above it, gRPC refuses uncounted."""
    return CEILING_FACTOR * max_message_bytes


@dataclass(frozen=True)
class _Oversized:
    """What the deserializer gives for a message over the limit: its size, not its bytes."""

    num_bytes: int


class MessageLimitInterceptor(grpc.aio.ServerInterceptor):
    """Refuses request messages over `max_bytes` with RESOURCE_EXHAUSTED, in every RPC."""

    def __init__(self, max_bytes: int) -> None:
        self._max_bytes = max_bytes

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        return _limited(handler, self._max_bytes)


def _limited(handler: grpc.RpcMethodHandler, max_bytes: int) -> grpc.RpcMethodHandler:
    """A handler of the same shape that refuses oversized messages before `handler` runs."""
    inner_deserialize = handler.request_deserializer

    def deserialize(data: bytes) -> Any:
        if len(data) > max_bytes:
            return _Oversized(len(data))
        return inner_deserialize(data) if inner_deserialize is not None else data

    async def refuse(oversized: _Oversized, context: grpc.aio.ServicerContext) -> NoReturn:
        await context.abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"Received message larger than max ({oversized.num_bytes} vs. {max_bytes})",
        )
        raise AssertionError("abort() returned")  # it raises AbortError

    serialize = handler.response_serializer
    if handler.request_streaming:
        behavior = handler.stream_stream or handler.stream_unary

        async def checked(
            requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
        ) -> AsyncIterator[Any]:
            async for request in requests:
                if isinstance(request, _Oversized):
                    await refuse(request, context)
                yield request

        if inspect.isasyncgenfunction(behavior):

            async def stream_stream(requests: Any, context: grpc.aio.ServicerContext) -> Any:
                async for response in behavior(checked(requests, context), context):
                    yield response

            return grpc.stream_stream_rpc_method_handler(stream_stream, deserialize, serialize)

        async def stream_call(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            return await behavior(checked(requests, context), context)

        if handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(stream_call, deserialize, serialize)
        return grpc.stream_unary_rpc_method_handler(stream_call, deserialize, serialize)

    if handler.response_streaming:
        streaming = handler.unary_stream
        # grpc.aio takes an async generator or a coroutine that writes through its
        # context; the wrapper keeps the shape of what it wraps.
        if inspect.isasyncgenfunction(streaming):

            async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if isinstance(request, _Oversized):
                    await refuse(request, context)
                async for response in streaming(request, context):
                    yield response

            return grpc.unary_stream_rpc_method_handler(unary_stream, deserialize, serialize)

        async def unary_writing(request: Any, context: grpc.aio.ServicerContext) -> None:
            if isinstance(request, _Oversized):
                await refuse(request, context)
            await streaming(request, context)

        return grpc.unary_stream_rpc_method_handler(unary_writing, deserialize, serialize)

    unary = handler.unary_unary

    async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Oversized):
            await refuse(request, context)
        return await unary(request, context)

    return grpc.unary_unary_rpc_method_handler(unary_unary, deserialize, serialize)
