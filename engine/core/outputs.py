"""What a generation yields to its caller: text chunks, then exactly one final result."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from engine.core.request import FinishReason

# Cross-process types live in engine.wire; the engine's callers also find them here.
from engine.wire import (  # noqa: F401
    GenerationInput,
    PoolName,
    TokenBatch,
    TokenUpdate,
    WorkerStats,
)


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
    # Speculative decoding since start: proposals verified, proposals accepted, and
    # verifications (one per request per verifying step).
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verifications: int = 0


class RequestUpdate(NamedTuple):
    """What one step did for one request: new tokens and, at the end, why it finished.
    (A NamedTuple: one is built per request per step.)"""

    req_id: str
    new_token_ids: tuple[int, ...]
    finish_reason: FinishReason | None
    num_cached_tokens: int = 0
    # The request left this engine with its blocks still allocated (prefill pool: they
    # hold the KV to hand off); whoever handles the update must release() them.
    hand_off: bool = False
