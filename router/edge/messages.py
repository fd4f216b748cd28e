"""Protobuf in and out of the gRPC edge: a GenerateRequest checked and converted to the
core's `GenerateCall` (router/serving/protocol.py), and the core's results to messages.
A bad field raises ValueError naming it (the servicer answers INVALID_ARGUMENT)."""

from __future__ import annotations

import math
import struct

from engine.core.outputs import FinalResult
from engine.core.request import FinishReason
from engine.sampling_params import SamplingParams
from engine.wire import PoolName
from pdserve.v1 import generation_pb2 as pb
from router.edge.request_ids import MAX_REQUEST_ID_CHARS, is_valid_request_id
from router.serving.errors import InvalidRequestError
from router.serving.protocol import ChatMessage, GenerateCall, PoolStats, ServerInfo

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64

FINISH_TO_PROTO = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
    FinishReason.ERROR: pb.FINISH_REASON_ERROR,
}
_POOL_TO_PROTO = {
    PoolName.PREFILL: pb.POOL_PREFILL,
    PoolName.DECODE: pb.POOL_DECODE,
    PoolName.COLOCATED: pb.POOL_COLOCATED,
}


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
        finish_reason=FINISH_TO_PROTO[result.finish_reason],
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
