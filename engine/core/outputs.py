"""What a generation yields to its caller: text chunks, then exactly one final result."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.request import FinishReason


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
    trace_id: str = ""  # the request's trace (32 hex digits), when it was traced
