"""The seam between the gRPC edge and the serving core: plain dataclasses, no protobuf."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from engine.core.outputs import FinalResult, TextChunk
from engine.sampling_params import SamplingParams
from engine.wire import WorkerStats


@dataclass(frozen=True)
class ChatMessage:
    """One chat turn, rendered by the core through the model's chat template."""

    role: str
    content: str


@dataclass(frozen=True)
class GenerateCall:
    """A validated Generate request; exactly one of the three inputs is not None."""

    request_id: str  # "" = the core assigns one
    prompt: str | None
    prompt_token_ids: tuple[int, ...] | None
    messages: tuple[ChatMessage, ...] | None
    sampling: SamplingParams
    priority: int = 0
    # The caller's W3C trace context (traceparent, tracestate) from the call's metadata.
    trace_parent: dict[str, str] = field(default_factory=dict, compare=False)
    include_trace_id: bool = False  # the final message carries the trace id
    # A resumed stream (router/serving/run/resume.py): the completion tokens the client has
    # of the request `request_id`; None for a new request.
    resume_from_tokens: int | None = None

    def __post_init__(self) -> None:
        num_inputs = sum(x is not None for x in (self.prompt, self.prompt_token_ids, self.messages))
        if num_inputs != 1:
            raise ValueError(
                f"exactly one of prompt, prompt_token_ids or messages must be set, got {num_inputs}"
            )


@dataclass(frozen=True)
class ServerInfo:
    """Static facts about a deployment."""

    model: str
    max_model_len: int
    block_size: int
    num_prefill_workers: int
    num_decode_workers: int
    max_in_flight: int
    max_queue: int
    num_colocated_workers: int = 0  # replicas that run both phases (no pools then)


@dataclass(frozen=True)
class PoolStats:
    """Every worker's occupancy plus the router's own admission counts."""

    workers: tuple[WorkerStats, ...]
    num_in_flight: int
    num_queued: int


@dataclass(frozen=True)
class ServerAbort:
    """Why the server ends a call in flight (a drain past its grace): the message of the
    CancelledError the servicer delivers to the call. A core that sees it may answer with
    its own final ABORT message (yielded; the request's usage and timings so far);
    otherwise the servicer writes one with what the edge knows."""

    reason: str


def server_abort(exc: BaseException) -> ServerAbort | None:
    """The ServerAbort a cancellation carries, or None (the client cancelled or left)."""
    reason = exc.args[0] if isinstance(exc, asyncio.CancelledError) and exc.args else None
    return reason if isinstance(reason, ServerAbort) else None


class Generator(Protocol):
    """What the gRPC servicer needs from the serving core."""

    def generate(self, call: GenerateCall) -> AsyncIterator[TextChunk | FinalResult]:
        """Stream chunks, then exactly one FinalResult.

        Raises (possibly on the first iteration) QueueFullError, NotReadyError
        or ValueError. The servicer closes the iterator (`aclose()`) when the
        client cancels or the deadline passes: the core must then abort the
        request and release its blocks. When the server ends the call, the
        cancellation carries a `ServerAbort` (see there).
        """
        ...

    def server_info(self) -> ServerInfo:
        """Static facts about the deployment."""
        ...

    async def pool_stats(self) -> PoolStats:
        """Live occupancy of every worker and the router queue."""
        ...

    def is_ready(self) -> bool:
        """True once the pools are warm and accept requests."""
        ...
