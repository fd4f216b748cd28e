"""grpc.aio GenerationService: validates protos, calls the core, maps results and errors."""

from __future__ import annotations

import asyncio
import logging
import math
import struct
from collections.abc import AsyncIterator
from contextvars import ContextVar

import grpc

from engine.core.outputs import FinalResult, TextChunk, Usage
from engine.core.request import FinishReason
from engine.sampling_params import SamplingParams
from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import generation_pb2_grpc as pb_grpc
from router.edge.streams import close_stream
from router.observability.tracing import trace_parent
from router.serving.errors import (
    InvalidRequestError,
    NotReadyError,
    QueueFullError,
    ResumeNotFoundError,
)
from router.serving.protocol import (
    ChatMessage,
    GenerateCall,
    Generator,
    PoolStats,
    ServerAbort,
    ServerInfo,
    server_abort,
)

logger = logging.getLogger(__name__)

# Set by the request-id interceptor (grpc_server.py) for the RPC being handled.
request_id_var: ContextVar[str] = ContextVar("pdserve_request_id", default="")

MAX_REQUEST_ID_CHARS = 128
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64

_FINISH_TO_PROTO = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
    FinishReason.ERROR: pb.FINISH_REASON_ERROR,
}
_POOL_TO_PROTO = {
    "prefill": pb.POOL_PREFILL,
    "decode": pb.POOL_DECODE,
    "colocated": pb.POOL_COLOCATED,
}

_Status = tuple[grpc.StatusCode, str]


def is_valid_request_id(request_id: str) -> bool:
    """True for 1-128 printable, non-space ASCII characters (safe as a metadata value)."""
    return 0 < len(request_id) <= MAX_REQUEST_ID_CHARS and all("!" <= c <= "~" for c in request_id)


def _shortest_float32(value: float) -> float:
    """The shortest decimal that is the same float32, e.g. 0.7 rather than 0.699999988.

    Keeps seeded sampling identical to the offline API, where users pass Python floats.
    """
    for digits in range(6, 10):
        candidate = float(f"{value:.{digits}g}")
        if struct.unpack("f", struct.pack("f", candidate))[0] == value:
            return candidate
    return value


def _finite(field: str, value: float) -> float:
    # SamplingParams' range checks let NaN through (every comparison is False).
    if not math.isfinite(value):
        raise InvalidRequestError(field, f"must be a finite number, got {value}")
    return _shortest_float32(value)


def to_sampling_params(sampling: pb.SamplingParams) -> SamplingParams:
    """Proto sampling -> engine SamplingParams; unset optional fields keep engine defaults."""
    if len(sampling.stop) > MAX_STOP_STRINGS:
        raise InvalidRequestError(
            "sampling.stop", f"at most {MAX_STOP_STRINGS} strings, got {len(sampling.stop)}"
        )
    if any(len(s) > MAX_STOP_STRING_CHARS for s in sampling.stop):
        raise InvalidRequestError(
            "sampling.stop", f"each string at most {MAX_STOP_STRING_CHARS} characters"
        )
    if len(sampling.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequestError(
            "sampling.stop_token_ids",
            f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(sampling.stop_token_ids)}",
        )
    kwargs: dict[str, object] = {
        "stop": tuple(sampling.stop),
        "stop_token_ids": tuple(sampling.stop_token_ids),
        "ignore_eos": sampling.ignore_eos,
    }
    if sampling.HasField("max_tokens"):
        kwargs["max_tokens"] = sampling.max_tokens
    if sampling.HasField("temperature"):
        kwargs["temperature"] = _finite("temperature", sampling.temperature)
    if sampling.HasField("top_p"):
        kwargs["top_p"] = _finite("top_p", sampling.top_p)
    if sampling.HasField("top_k"):
        kwargs["top_k"] = sampling.top_k
    if sampling.HasField("seed"):
        kwargs["seed"] = sampling.seed
    # SamplingParams raises ValueError naming the field and its range.
    return SamplingParams(**kwargs)  # type: ignore[arg-type]


def to_generate_call(
    request: pb.GenerateRequest,
    *,
    request_id: str,
    max_model_len: int | None = None,
    trace_context: dict[str, str] | None = None,
) -> GenerateCall:
    """Validate a GenerateRequest and convert it; raises ValueError naming the bad field."""
    if request_id and not is_valid_request_id(request_id):
        raise InvalidRequestError(
            "request_id", f"1-{MAX_REQUEST_ID_CHARS} printable ASCII characters, no spaces"
        )
    prompt: str | None = None
    token_ids: tuple[int, ...] | None = None
    messages: tuple[ChatMessage, ...] | None = None
    which = request.WhichOneof("input")
    if which is None:
        raise InvalidRequestError(
            "input", "exactly one of prompt, prompt_token_ids or messages must be set"
        )
    if which == "prompt":
        if not request.prompt:
            raise InvalidRequestError("prompt", "must not be empty")
        prompt = request.prompt
    elif which == "prompt_token_ids":
        token_ids = tuple(request.prompt_token_ids.token_ids)
        if not token_ids:
            raise InvalidRequestError("prompt_token_ids.token_ids", "must not be empty")
        if max_model_len is not None and len(token_ids) >= max_model_len:
            raise InvalidRequestError(
                "prompt_token_ids.token_ids",
                f"{len(token_ids)} tokens leave no room to generate; "
                f"the limit is max_model_len - 1 = {max_model_len - 1}",
            )
    else:
        if not request.messages.messages:
            raise InvalidRequestError("messages.messages", "must not be empty")
        for i, m in enumerate(request.messages.messages):
            if not m.role:
                raise InvalidRequestError(f"messages.messages[{i}].role", "must not be empty")
        messages = tuple(ChatMessage(m.role, m.content) for m in request.messages.messages)
    return GenerateCall(
        request_id=request_id,
        prompt=prompt,
        prompt_token_ids=token_ids,
        messages=messages,
        sampling=to_sampling_params(request.sampling),
        priority=request.priority,
        trace_parent=trace_context or {},
        include_trace_id=request.include_trace_id,
        resume_from_tokens=(
            request.resume_from_tokens if request.HasField("resume_from_tokens") else None
        ),
    )


def final_response(
    request_id: str, result: FinalResult, include_trace_id: bool = False
) -> pb.GenerateResponse:
    """The terminal stream message for a FinalResult (with its trace id if asked)."""
    t = result.timings
    return pb.GenerateResponse(
        request_id=request_id,
        finish_reason=_FINISH_TO_PROTO[result.finish_reason],
        usage=pb.Usage(
            prompt_tokens=result.usage.prompt_tokens,
            completion_tokens=result.usage.completion_tokens,
            cached_prompt_tokens=result.usage.cached_prompt_tokens,
        ),
        timings=pb.Timings(
            queued_seconds=t.queued_s,
            prefill_seconds=t.prefill_s,
            kv_transfer_seconds=t.kv_transfer_s,
            decode_seconds=t.decode_s,
            time_to_first_token_seconds=t.time_to_first_token_s,
            kv_wire_seconds=t.kv_wire_s,
            local_prefill=t.local_prefill,
            trace_id=result.trace_id if include_trace_id else "",
        ),
        error=result.error,
    )


def server_info_response(info: ServerInfo) -> pb.GetServerInfoResponse:
    """ServerInfo -> proto."""
    return pb.GetServerInfoResponse(
        model=info.model,
        max_model_len=info.max_model_len,
        block_size=info.block_size,
        num_prefill_workers=info.num_prefill_workers,
        num_decode_workers=info.num_decode_workers,
        num_colocated_workers=info.num_colocated_workers,
        max_in_flight=info.max_in_flight,
        max_queue=info.max_queue,
    )


def pool_stats_response(stats: PoolStats) -> pb.GetPoolStatsResponse:
    """PoolStats -> proto."""
    return pb.GetPoolStatsResponse(
        workers=[
            pb.WorkerStats(
                pool=_POOL_TO_PROTO.get(w.pool, pb.POOL_UNSPECIFIED),
                index=w.index,
                num_blocks_total=w.num_blocks_total,
                num_blocks_in_use=w.num_blocks_in_use,
                num_running=w.num_running,
                num_waiting=w.num_waiting,
                prefix_hit_tokens=w.prefix_hit_tokens,
                prefix_query_tokens=w.prefix_query_tokens,
                spec_decode_draft_tokens=w.spec_draft_tokens,
                spec_decode_accepted_tokens=w.spec_accepted_tokens,
                spec_decode_mean_accepted_length=w.spec_mean_accepted_length,
            )
            for w in stats.workers
        ],
        num_in_flight=stats.num_in_flight,
        num_queued=stats.num_queued,
    )


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
        num_sent = [0]  # completion tokens the client already has, for an ABORT's usage
        try:
            async with timeout:
                status = await self._forward(stream, call, context, num_sent)
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
                final = FinalResult(FinishReason.ABORT, Usage(0, num_sent[0]), error=abort.reason)
                logger.info("request %s aborted: %s", call.request_id, abort.reason)
            await context.write(final_response(call.request_id, final, call.include_trace_id))
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
            await close_stream(stream, call.request_id)

    async def _forward(
        self,
        stream: AsyncIterator[TextChunk | FinalResult],
        call: GenerateCall,
        context: grpc.aio.ServicerContext,
        num_sent: list[int],
    ) -> _Status | None:
        request_id = call.request_id
        async for out in stream:
            if isinstance(out, TextChunk):
                if out.text or out.token_ids:
                    await context.write(
                        pb.GenerateResponse(
                            request_id=request_id, text=out.text, token_ids=out.token_ids
                        )
                    )
                    num_sent[0] += len(out.token_ids)
                continue
            if out.finish_reason not in _FINISH_TO_PROTO:
                return grpc.StatusCode.INTERNAL, f"unexpected finish reason {out.finish_reason}"
            await context.write(final_response(request_id, out, call.include_trace_id))
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
