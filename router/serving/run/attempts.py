"""One request's tries: each attempt has its own id, and what the client has seen so far
(`Progress`) carries across them.

An attempt that is lost (`WorkerLost`) is followed by one that continues the request:
before any token reached the client it starts over; after, its prompt is the original
prompt plus every token already streamed and it asks for the tokens still to come
(`continuation`). Sampling is a function of (seed, position), so the continuation gives
the tokens the lost attempt would have given.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from engine.core.outputs import FinalResult, PhaseTimings, Usage
from engine.core.request import FinishReason
from engine.frontend.output_processor import OutputProcessor
from engine.wire import GenerationInput
from router.routing.worker_load import WorkerLease
from router.serving.inbox import UpdateInbox
from router.serving.workers import WorkerRef

log = logging.getLogger(__name__)


class WorkerLost(RuntimeError):
    """An attempt cannot go on where it is: continue the request in a new attempt.
    `run_locally`: the prefill pool failed it before any KV left (or a live decode worker
    refused its KV), so the next attempt runs the prompt on a decode worker.
    `worker`: the worker the request was on, when that worker is gone (`why`: died or
    drained); after streamed tokens the next attempt is then a migration
    (router/serving/run/migrations.py)."""

    def __init__(
        self,
        reason: str,
        run_locally: bool = False,
        worker: WorkerRef | None = None,
        why: str = "worker_died",
    ) -> None:
        super().__init__(reason)
        self.run_locally = run_locally
        self.worker = worker
        self.why = why


@dataclass(eq=False)  # compared (and hashed) by identity: its id changes when it moves
class Attempt:
    """One try at running a request; its id is what the workers know it by."""

    inp: GenerationInput
    request_id: str = ""  # what the client knows the request by (for the log)
    number: int = 0  # of the request's attempts, from 0
    inbox: UpdateInbox = field(default_factory=UpdateInbox)
    decode_ref: WorkerRef | None = None
    prefill_ref: WorkerRef | None = None
    leases: list[WorkerLease] = field(default_factory=list)
    resumes_after: int = 0  # tokens the client saw before this attempt began

    @property
    def req_id(self) -> str:
        return self.inp.req_id


@dataclass(eq=False)  # one per request, compared (and hashed) by identity
class Progress:
    """What the client has seen so far, across attempts."""

    arrival: float
    output: OutputProcessor  # the text streamed so far (stop strings included)
    token_ids: list[int] = field(default_factory=list)  # every token streamed
    num_cached: int = 0
    t_first: float | None = None
    t_decoding: float = 0.0
    timings: PhaseTimings = field(default_factory=PhaseTimings)
    finish_reason: FinishReason = FinishReason.ERROR  # set when the stream ends
    num_resumed: int = 0  # attempts that continued after streamed tokens
    num_migrations: int = 0  # of those, moves off a worker that was lost
    num_moved: int = 0  # moves with the KV off a draining worker (no recompute)

    def note_cached(self, attempt: Attempt, num_cached_tokens: int) -> None:
        """Prompt tokens served from a prefix cache, as the client counts them: a
        continuation's prompt is the client's prompt plus tokens it already has, so only
        an attempt that ran the client's own prompt counts."""
        if not attempt.resumes_after:
            self.num_cached = max(self.num_cached, num_cached_tokens)

    @property
    def num_out(self) -> int:
        return len(self.token_ids)

    def tpot_s(self) -> float | None:
        """Mean time per output token after the first, so far (None below two tokens)."""
        if self.t_first is None or self.num_out < 2:
            return None
        return (time.perf_counter() - self.t_first) / (self.num_out - 1)

    def since_arrival(self) -> float:
        return time.perf_counter() - self.arrival

    def mark_decoding(self, timings: PhaseTimings) -> None:
        """The prompt ran (or was handed to its decode worker): keep the first
        attempt's phase timings, which are the client's."""
        if not self.t_decoding:
            self.timings = timings
        self.t_decoding = self.t_decoding or time.perf_counter()


@dataclass(eq=False)  # one per request, compared (and hashed) by identity
class ClientRequest:
    """A request as the client sent it: what the client knows it by (its own id, or the
    one the router gave it), its validated input, its caller's trace context, and what
    the client has seen so far."""

    request_id: str
    base: GenerationInput
    progress: Progress
    trace_parent: Mapping[str, str] = field(default_factory=dict)
    trace_id: str = ""  # 32 hex digits once traced (tracing names it as the request arrives)


def continuation(base: GenerationInput, number: int, progress: Progress) -> GenerationInput:
    """Attempt `number` of a request: itself, or (after tokens were streamed) the prompt
    plus those tokens, asking for the rest."""
    req_id = base.req_id if number == 0 else f"{base.req_id}-{number}"
    inp = replace(base, req_id=req_id)
    if progress.num_out:
        inp = replace(
            inp,
            prompt_token_ids=base.prompt_token_ids + tuple(progress.token_ids),
            sampling=replace(base.sampling, max_tokens=base.sampling.max_tokens - progress.num_out),
        )
    return inp


def final_result(request: ClientRequest, reason: FinishReason, error: str = "") -> FinalResult:
    """The request's one terminal message (and its log line)."""
    progress, trace_id = request.progress, request.trace_id
    end = time.perf_counter()
    timings = replace(
        progress.timings,
        decode_s=end - progress.t_decoding if progress.t_decoding else 0.0,
        time_to_first_token_s=(progress.t_first or end) - progress.arrival,
    )
    usage = Usage(len(request.base.prompt_token_ids), progress.num_out, progress.num_cached)
    result = FinalResult(reason, usage, timings, error, trace_id)
    t = result.timings
    log.info(
        "request %s finished=%s prompt=%d out=%d cached=%d queued=%.3fs prefill=%.3fs "
        "kv=%.4fs (wire %.4fs) decode=%.3fs ttft=%.3fs%s%s%s%s%s",
        request.request_id,
        result.finish_reason.value,
        usage.prompt_tokens,
        usage.completion_tokens,
        usage.cached_prompt_tokens,
        t.queued_s,
        t.prefill_s,
        t.kv_transfer_s,
        t.kv_wire_s,
        t.decode_s,
        t.time_to_first_token_s,
        " local" if t.local_prefill else "",
        f" resumed={progress.num_resumed}" if progress.num_resumed else "",
        f" migrated={progress.num_migrations}" if progress.num_migrations else "",
        f" moved={progress.num_moved}" if progress.num_moved else "",
        f" trace={trace_id}" if trace_id else "",
    )
    return result
