"""grpc.aio GenerationService: validates protos (router/edge/messages.py), calls the core,
maps results and errors."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc

from engine.core.outputs import FinalResult, TextChunk, Usage
from engine.core.request import FinishReason
from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import generation_pb2_grpc as pb_grpc
from router.edge.messages import (
    FINISH_TO_PROTO,
    final_response,
    pool_stats_response,
    server_info_response,
    to_generate_call,
)
from router.edge.request_ids import request_id_var
from router.edge.streams import close_stream
from router.observability.tracing import trace_parent
from router.serving.errors import NotReadyError, QueueFullError, ResumeNotFoundError
from router.serving.protocol import (
    GenerateCall,
    Generator,
    ServerAbort,
    server_abort,
)

logger = logging.getLogger(__name__)

_Status = tuple[grpc.StatusCode, str]
# How long a call the server aborts waits for the core's own final message (its usage and
# timings) before the edge sends one: well within the flush the server stops after, so
# that every aborted call has its final message out before its connection goes, even
# when the core is stuck on its way out (a call to a worker that went down with it).
CORE_FINAL_WAIT_S = 0.5
# A chunk's write that a server abort cut off may still be in gRPC's core, which takes
# one write a call at a time: the final message is tried again until it has gone.
FINAL_RETRY_S = 0.5
FINAL_RETRY_EVERY_S = 0.005


class _OpenCall:
    """A Generate call in flight: where its one final message goes, written once by
    whichever comes first, the handler or the edge's fallback after an abort."""

    def __init__(self, context: grpc.aio.ServicerContext, call: GenerateCall) -> None:
        self.context = context
        self.call = call
        self.num_sent = [0]  # completion tokens the client already has, for an ABORT's usage
        self.final_sent = False
        self.writing = False  # a chunk's write was started and has not returned

    async def write_chunk(self, message: pb.GenerateResponse) -> None:
        # `writing` stays set when the write is cut off (cancelled mid-way).
        self.writing = True
        await self.context.write(message)
        self.writing = False

    async def write_final(self, final: FinalResult) -> bool:
        """Send the call's final message unless one went already; True if this one did."""
        if self.final_sent:
            return False
        self.final_sent = True
        call = self.call
        message = final_response(call.request_id, final, call.include_trace_id)
        # Tried again only when a cancel cut a chunk's write off: its operation may
        # still be in gRPC's core.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (FINAL_RETRY_S if self.writing else 0.0)
        while True:
            try:
                await self.context.write(message)
                return True
            except Exception:
                if loop.time() >= deadline:
                    raise
            await asyncio.sleep(FINAL_RETRY_EVERY_S)


def _failure_status(exc: Exception, what: str) -> _Status:
    """The status a core exception maps to; anything unexpected is logged and INTERNAL."""
    if isinstance(exc, QueueFullError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc) or "admission queue is full"
    if isinstance(exc, NotReadyError):
        return grpc.StatusCode.UNAVAILABLE, str(exc) or "server is not ready"
    if isinstance(exc, ResumeNotFoundError):
        return grpc.StatusCode.NOT_FOUND, str(exc)
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    logger.exception("%s failed", what, exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {exc!r}"


def _cancelling() -> int:
    task = asyncio.current_task()
    return task.cancelling() if task is not None else 0


async def _final_from_core(
    stream: AsyncIterator[TextChunk | FinalResult], abort: ServerAbort
) -> FinalResult | None:
    """The core's final ABORT message for a server abort delivered while its stream was
    suspended between items; None when it has none to give."""
    athrow = getattr(stream, "athrow", None)
    if athrow is None:
        return None
    thrown = asyncio.CancelledError(abort)
    try:
        out = await athrow(thrown)
    except asyncio.CancelledError as exc:
        if exc is not thrown:
            raise  # a cancellation of this call's own
        return None
    except (StopAsyncIteration, RuntimeError):
        return None
    return out if isinstance(out, FinalResult) else None


class GenerationServicer(pb_grpc.GenerationServiceServicer):
    """Edge of the router: proto in, GenerateCall to the core, proto stream out."""

    def __init__(self, generator: Generator) -> None:
        self._generator = generator
        self._draining = False
        self._num_in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        # Handler tasks of in-flight Generate calls, so a drain past its grace can end them.
        self._handlers: set[asyncio.Task[None]] = set()
        self._open: dict[asyncio.Task[Any], _OpenCall] = {}
        self._fallbacks: set[asyncio.Task[None]] = set()
        self._abort_reason: str | None = None

    @property
    def num_in_flight(self) -> int:
        """Generate calls currently being handled."""
        return self._num_in_flight

    def start_draining(self) -> None:
        """Refuse new Generate calls with UNAVAILABLE; in-flight ones continue."""
        self._draining = True

    async def wait_idle(self) -> None:
        """Return once no Generate call is in flight."""
        await self._idle.wait()

    def abort_in_flight(self, reason: str) -> None:
        """End every in-flight Generate with a final ABORT message carrying `reason`.

        The calls are cancelled like a client cancel (closing the core's stream frees the
        request's blocks), but the stream still gets its final message and status OK.
        """
        self._abort_reason = reason
        for task in self._handlers:
            task.cancel(ServerAbort(reason))
            open_call = self._open.get(task)
            if open_call is not None:
                fallback = asyncio.ensure_future(self._fallback_final(open_call, reason))
                self._fallbacks.add(fallback)
                fallback.add_done_callback(self._fallbacks.discard)

    async def _fallback_final(self, open_call: _OpenCall, reason: str) -> None:
        """The edge's final ABORT for a call whose core has not answered its abort in
        time; the handler, should it come back, sends nothing more."""
        await asyncio.sleep(CORE_FINAL_WAIT_S)
        final = FinalResult(FinishReason.ABORT, Usage(0, open_call.num_sent[0]), error=reason)
        with contextlib.suppress(Exception):  # the call may have ended meanwhile
            if await open_call.write_final(final):
                logger.warning(
                    "request %s aborted: %s (its core did not answer in %.1f s)",
                    open_call.call.request_id,
                    reason,
                    CORE_FINAL_WAIT_S,
                )

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        """Stream chunks and one final message; see the status table in generation.proto."""
        if self._draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "server is draining")
        if not self._generator.is_ready():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "server is not ready")
        self._num_in_flight += 1
        self._idle.clear()
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)  # type: ignore[arg-type]
        try:
            await self._generate(request, context)
        finally:
            self._handlers.discard(task)  # type: ignore[arg-type]
            self._num_in_flight -= 1
            if self._num_in_flight == 0:
                self._idle.set()

    async def _generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        request_id = request.request_id or request_id_var.get()
        try:
            call = to_generate_call(
                request,
                request_id=request_id,
                max_model_len=self._generator.server_info().max_model_len,
                trace_context=trace_parent(context.invocation_metadata()),
            )
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

        status = await self._run(call, context)
        if status is not None:
            await context.abort(*status)

    async def _run(self, call: GenerateCall, context: grpc.aio.ServicerContext) -> _Status | None:
        """Stream the core's outputs; return the failure status, if any, to abort with."""
        try:
            stream = self._generator.generate(call)
        except Exception as exc:  # noqa: BLE001 - a core may refuse before returning a stream
            return _failure_status(exc, call.request_id)
        # None = no deadline; grpc also cancels the handler at the deadline, but
        # timing out here first lets us close the core's stream and say why.
        timeout = asyncio.timeout(context.time_remaining())
        open_call = _OpenCall(context, call)
        task = asyncio.current_task()
        if task is not None:
            self._open[task] = open_call
        try:
            async with timeout:
                status = await self._forward(stream, open_call)
            if self._abort_reason is not None and _cancelling():
                # Our own cancel reached the core, which answered it with its final message.
                asyncio.current_task().uncancel()  # type: ignore[union-attr]
            return status
        except asyncio.CancelledError as exc:
            abort = server_abort(exc)
            if abort is None:
                raise  # the client cancelled or went away: nobody to tell
            # Our own cancel (abort_in_flight) while the core's stream was waiting for this
            # call: the core is told as if it had been cancelled itself, and its final
            # message (usage and timings so far) goes out; a core that does not answer gets
            # the edge's. The `finally` below closes the core's stream as on any cancel.
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
            final = await _final_from_core(stream, abort)
            if final is None:
                usage = Usage(0, open_call.num_sent[0])
                final = FinalResult(FinishReason.ABORT, usage, error=abort.reason)
                logger.info("request %s aborted: %s", call.request_id, abort.reason)
            await open_call.write_final(final)
            return None
        except TimeoutError:
            if not timeout.expired():
                raise
            logger.info("request %s: deadline exceeded", call.request_id)
            return grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded; request aborted"
        except Exception as exc:  # noqa: BLE001 - every failure must end the RPC with a status
            return _failure_status(exc, call.request_id)
        finally:
            # Also runs when grpc cancels this task (client cancelled or went away).
            self._open.pop(task, None)  # type: ignore[arg-type]
            await close_stream(stream, call.request_id)

    async def _forward(
        self, stream: AsyncIterator[TextChunk | FinalResult], open_call: _OpenCall
    ) -> _Status | None:
        request_id = open_call.call.request_id
        async for out in stream:
            if open_call.final_sent:
                return None  # the edge ended the call after an abort the core was slow to take
            if isinstance(out, TextChunk):
                if out.text or out.token_ids:
                    await open_call.write_chunk(
                        pb.GenerateResponse(
                            request_id=request_id, text=out.text, token_ids=out.token_ids
                        )
                    )
                    open_call.num_sent[0] += len(out.token_ids)
                continue
            if out.finish_reason not in FINISH_TO_PROTO:
                return grpc.StatusCode.INTERNAL, f"unexpected finish reason {out.finish_reason}"
            if not await open_call.write_final(out):
                return None
            if out.finish_reason is FinishReason.ERROR:
                return grpc.StatusCode.INTERNAL, out.error or "generation failed"
            return None
        return grpc.StatusCode.INTERNAL, "generation ended without a final result"

    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetServerInfoResponse:
        """Static deployment facts."""
        return server_info_response(self._generator.server_info())

    async def GetPoolStats(
        self, request: pb.GetPoolStatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetPoolStatsResponse:
        """Live worker occupancy and router queue counts."""
        try:
            stats = await self._generator.pool_stats()
        except Exception as exc:  # noqa: BLE001
            await context.abort(*_failure_status(exc, "GetPoolStats"))
        return pool_stats_response(stats)
