"""A request's state inside one engine: tokens, progress and status."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.core.speculation import SpecState

# Stands for a token that a launched step is sampling and the host has not seen yet
# (scheduling one step ahead). The runner feeds the real id on the device.
PLACEHOLDER_TOKEN = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # cancelled by the caller
    ERROR = "error"  # failed inside the system


@dataclass
class Request:
    """Mutable per-request state owned by one scheduler.

    Progress is `num_computed_tokens` catching up with `num_tokens`: a prompt
    chunk, a decode step and a recompute after preemption are the same thing.
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    seed: int  # resolved seed: the sampler's randomness is a function of (seed, position)
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0  # lower value runs first under the priority policy
    arrival_time: float = field(default_factory=time.monotonic)
    max_model_len: int | None = None
    # Decode pool: the prompt arrives with its KV already computed; the first
    # sampled token travels with it (sampling state moves with the request).
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV a finished step wrote
    # Tokens of launched steps whose results the scheduler has not applied yet: the
    # next step starts after them (scheduling one step ahead).
    num_inflight_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    # Prompt followed by every token sampled so far: one list that grows by one token
    # a step (the scheduler slices it every step; rebuilding it would cost O(length)).
    all_token_ids: list[int] = field(init=False, repr=False)
    # Chain hashes of the first full blocks of all_token_ids (tokens only ever append,
    # so they stay valid), filled by prefix-cache lookups: a request that waits for
    # blocks is not re-hashed every step.
    block_hashes: list[int] = field(default_factory=list, init=False, repr=False)
    # Speculative decoding's per-request state (engine.core.speculation), when it speculates.
    spec_state: SpecState | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.all_token_ids = [*self.prompt_token_ids, *self.output_token_ids]

    def append_output_token(self, token_id: int) -> None:
        """Record one sampled token, or PLACEHOLDER_TOKEN for one a launched step is
        still sampling (`set_output_token` fills it in)."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def set_output_token(self, position: int, token_id: int) -> None:
        """Fill in the placeholder at `position` (of all_token_ids) with the sampled token."""
        self.all_token_ids[position] = token_id
        self.output_token_ids[position - len(self.prompt_token_ids)] = token_id

    def drop_placeholders(self) -> None:
        """Forget tokens still being sampled (preemption: the recompute samples them again,
        and the sampler's randomness depends only on seed and position)."""
        while self.output_token_ids and self.output_token_ids[-1] == PLACEHOLDER_TOKEN:
            self.output_token_ids.pop()
            self.all_token_ids.pop()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def check_stop(self, num_outputs: int) -> FinishReason | None:
        """Token-level stop rules for output token number `num_outputs` (later outputs may
        still be placeholders when scheduling runs ahead)."""
        if num_outputs <= 0:
            return None
        last, sampling = self.output_token_ids[num_outputs - 1], self.sampling
        if (not sampling.ignore_eos and last in self.eos_token_ids) or (
            last in sampling.stop_token_ids
        ):
            return FinishReason.STOP
        return self.length_stop(num_outputs)

    def length_stop(self, num_outputs: int) -> FinishReason | None:
        """LENGTH once `num_outputs` outputs reach max_tokens or the model's context."""
        if num_outputs >= self.sampling.max_tokens:
            return FinishReason.LENGTH
        max_len = self.max_model_len
        if max_len is not None and len(self.prompt_token_ids) + num_outputs >= max_len:
            return FinishReason.LENGTH
        return None
