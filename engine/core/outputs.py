"""What a generation yields to its caller: text chunks, then exactly one final result."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from engine.core.kv_events import KVEvents
from engine.core.request import FinishReason
from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class GenerationInput:
    """A validated request as the frontends (offline API, router) hand it to a backend.

    Exactly one of `prompt`, `prompt_token_ids` or `messages` was given by the
    user; the frontend has already rendered and tokenized it into `prompt_token_ids`.
    """

    req_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    priority: int = 0


@dataclass(frozen=True)
class TextChunk:
    """New text and the token ids it came from (text may lag tokens to keep UTF-8 whole)."""

    text: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class PhaseTimings:
    """Seconds spent in each phase of the router's state machine (0 where not applicable)."""

    queued_s: float = 0.0
    prefill_s: float = 0.0
    kv_transfer_s: float = 0.0
    decode_s: float = 0.0
    time_to_first_token_s: float = 0.0
    kv_wire_s: float = 0.0  # the decode worker's receive of the KV
    local_prefill: bool = False  # the decode worker ran the prompt: no hand-off


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0


@dataclass(frozen=True)
class FinalResult:
    """The one terminal message of every request."""

    finish_reason: FinishReason
    usage: Usage
    timings: PhaseTimings = field(default_factory=PhaseTimings)
    error: str = ""  # set when finish_reason is ERROR


@dataclass(frozen=True)
class EngineStats:
    """Occupancy of one engine's KV cache and scheduler, and its counters since start."""

    num_blocks_total: int
    num_blocks_in_use: int
    num_running: int
    num_waiting: int
    prefix_hit_tokens: int
    prefix_query_tokens: int
    num_preemptions: int = 0


@dataclass(frozen=True)
class TokenUpdate:
    """One request's news from a decode worker: new tokens, its arrival, or its end."""

    req_id: str
    new_token_ids: tuple[int, ...] = ()
    finish_reason: FinishReason | None = None
    num_cached_tokens: int = 0
    error: str = ""  # with finish_reason ERROR: what went wrong on the worker
    # Set once, when the request's KV has arrived: the receive itself, and the whole
    # hand-off from the sender's KV being ready to the KV in place.
    kv_wire_s: float = 0.0
    kv_handoff_s: float = 0.0


@dataclass(frozen=True)
class TokenBatch:
    """Every update of one or more steps, for every request, in one message."""

    updates: tuple[TokenUpdate, ...]
    # The worker's prefix-cache changes since the last batch, in order (for routing).
    kv_events: tuple[KVEvents, ...] = ()
    stats: WorkerStats | None = None  # occupancy when the batch left (for routing)


PoolName = Literal["prefill", "decode", "colocated"]


@dataclass(frozen=True)
class WorkerStats:
    """Occupancy of one worker's KV cache and scheduler."""

    pool: PoolName
    index: int
    num_blocks_total: int
    num_blocks_in_use: int
    num_running: int
    num_waiting: int
    prefix_hit_tokens: int
    prefix_query_tokens: int
    num_preemptions: int = 0  # since this worker started
