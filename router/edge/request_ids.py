"""Every call's request id: the request body's `request_id`, else the `x-request-id`
header, else a new uuid; checked, visible to the handler (`request_id_var`) and sent
back as the `x-request-id` response header, so clients can quote it in reports.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextvars import ContextVar
from typing import Any, NoReturn

import grpc

REQUEST_ID_HEADER = "x-request-id"
MAX_REQUEST_ID_CHARS = 128

# Set by the interceptor for the RPC being handled.
request_id_var: ContextVar[str] = ContextVar("pdserve_request_id", default="")


def is_valid_request_id(request_id: str) -> bool:
    """True for 1-128 printable, non-space ASCII characters (safe as a metadata value)."""
    return 0 < len(request_id) <= MAX_REQUEST_ID_CHARS and all("!" <= c <= "~" for c in request_id)


class RequestIdInterceptor(grpc.aio.ServerInterceptor):
    """Gives every unary-request RPC an id: body `request_id`, else `x-request-id`, else a uuid.

    The id is visible to the handler through `request_id_var` and is sent back
    as the `x-request-id` response header, so clients can quote it in reports.
    """

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        # Streaming-request RPCs (only reflection here) have no body id to prefer.
        if handler is None or handler.request_streaming:
            return handler
        header = ""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == REQUEST_ID_HEADER and isinstance(value, str):
                header = value
        if handler.response_streaming:
            behavior = _wrap_stream(handler.unary_stream, header)
            return grpc.unary_stream_rpc_method_handler(
                behavior, handler.request_deserializer, handler.response_serializer
            )
        return grpc.unary_unary_rpc_method_handler(
            _wrap_unary(handler.unary_unary, header),
            handler.request_deserializer,
            handler.response_serializer,
        )


@contextlib.asynccontextmanager
async def _request_id(
    request: Any, context: grpc.aio.ServicerContext, header: str
) -> AsyncIterator[tuple[tuple[str, str], ...]]:
    """Resolve, validate and publish the call's request id (body, else header, else a new
    one; INVALID_ARGUMENT if bad) for the block; gives the response headers echoing it."""
    body_id = getattr(request, "request_id", "")
    request_id = body_id or header or uuid.uuid4().hex
    if not is_valid_request_id(request_id):
        field = "request_id" if body_id else REQUEST_ID_HEADER
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{field}: 1-128 printable ASCII characters, no spaces",
        )
    token = request_id_var.set(request_id)
    try:
        yield ((REQUEST_ID_HEADER, request_id),)
    finally:
        request_id_var.reset(token)


def _wrap_unary(behavior: Callable[..., Any], header: str) -> Callable[..., Any]:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
        async with _request_id(request, context, header) as headers:
            await context.send_initial_metadata(headers)
            return await behavior(request, context)

    return wrapped


def _wrap_stream(behavior: Callable[..., Any], header: str) -> Callable[..., Any]:
    # grpc.aio accepts either an async generator or a coroutine using context.write;
    # the wrapper must have the same shape as what it wraps.
    if inspect.isasyncgenfunction(behavior):

        async def wrapped_gen(request: Any, context: grpc.aio.ServicerContext) -> Any:
            async with _request_id(request, context, header) as headers:
                await context.send_initial_metadata(headers)
                async for response in behavior(request, context):
                    yield response

        return wrapped_gen

    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> None:
        async with _request_id(request, context, header) as headers:
            ahead = _HeadersAhead(context, headers)
            try:
                await behavior(request, ahead)
            finally:
                await ahead.sent()

    return wrapped


class _HeadersAhead:
    """A writing handler's context while its response headers are on their way.

    Sending headers is a round of the call's own (through gRPC's poller thread and
    back to the event loop, about 0.2 ms on an idle router). A Generate call's handler
    needs them only with its first token, so they leave while it admits, routes and
    submits the request; a write or an abort waits for them first, since gRPC sends
    headers once, before any message or status, and the handler's end waits too."""

    def __init__(self, inner: grpc.aio.ServicerContext, headers: tuple[tuple[str, str], ...]):
        self._inner = inner
        self._sending = asyncio.ensure_future(inner.send_initial_metadata(headers))
        # Read its failure (the call gone meanwhile) even if no one waits for it.
        self._sending.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def sent(self) -> None:
        """Wait for the headers to leave; a call gone meanwhile is the next write's to say."""
        with contextlib.suppress(Exception):
            # Shielded: a cancelled handler must not cancel the headers' send in flight,
            # or gRPC would send them again with the status.
            await asyncio.shield(self._sending)

    async def write(self, message: Any) -> None:
        await self.sent()
        await self._inner.write(message)

    async def abort(self, *args: Any, **kwargs: Any) -> NoReturn:
        await self.sent()
        await self._inner.abort(*args, **kwargs)
        raise AssertionError("abort() returned")  # it raises AbortError

    async def abort_with_status(self, status: Any) -> NoReturn:
        await self.sent()
        await self._inner.abort_with_status(status)
        raise AssertionError("abort_with_status() returned")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
