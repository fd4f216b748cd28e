"""A request's state inside one engine: tokens, progress and status."""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, overload

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.spec.speculation import SpecState

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


class TokenView(Sequence[int]):
    """A read-only window on a request's one token list: its prompt, or its outputs so
    far (a window without an end grows with the list). Slicing one gives a list."""

    __slots__ = ("_tokens", "_start", "_stop")

    def __init__(self, tokens: list[int], start: int, stop: int | None = None) -> None:
        self._tokens = tokens
        self._start = start
        self._stop = stop

    def _end(self) -> int:
        return len(self._tokens) if self._stop is None else self._stop

    def __len__(self) -> int:
        return self._end() - self._start

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...
    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            return self._tokens[self._start : self._end()][index]
        size = len(self)
        if index < 0:
            index += size
        if not 0 <= index < size:
            raise IndexError("token index out of range")
        return self._tokens[self._start + index]

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(self._tokens, self._start, self._end())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]  # a live view: equal now, not forever

    def __repr__(self) -> str:
        return f"TokenView({list(self)!r})"


@dataclass
class Request:
    """Mutable per-request state owned by one scheduler.

    Progress is `num_computed_tokens` catching up with `num_tokens`: a prompt
    chunk, a decode step and a recompute after preemption are the same thing.
    """

    req_id: str
    # The prompt followed by every token sampled so far (PLACEHOLDER_TOKEN for one a
    # launched step is still sampling): the request's one token list, growing by one
    # token a step. `prompt_token_ids` and `output_token_ids` are views of it.
    all_token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    seed: int  # resolved seed: the sampler's randomness is a function of (seed, position)
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0  # lower value runs first under the priority policy
    arrival_time: float = field(default_factory=time.monotonic)
    max_model_len: int | None = None
    num_computed_tokens: int = 0  # tokens whose KV a finished step wrote
    # Tokens of launched steps whose results the scheduler has not applied yet: the
    # next step starts after them (scheduling one step ahead).
    num_inflight_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    # time.monotonic() when a step first scheduled it (0: not yet): the end of its wait
    # in this engine's queue, for the worker's phase timings.
    scheduled_at: float = 0.0
    # Chain hashes of the first full blocks of all_token_ids (tokens only ever append,
    # so they stay valid), filled by prefix-cache lookups: a request that waits for
    # blocks is not re-hashed every step.
    block_hashes: list[int] = field(default_factory=list, init=False, repr=False)
    # Speculative decoding's per-request state (engine.spec.speculation), when it speculates.
    spec_state: SpecState | None = field(default=None, init=False, repr=False)
    # The stop rules, resolved once (the scheduler checks them for every request every
    # step): the token ids that end it (its stop tokens, and EOS unless ignored), and the
    # output count that does (max_tokens, or where the model's context ends if sooner).
    stop_ids: frozenset[int] = field(init=False, repr=False)
    max_outputs: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.num_prompt_tokens <= len(self.all_token_ids):
            raise ValueError(
                f"request {self.req_id!r}: {self.num_prompt_tokens} prompt tokens of "
                f"{len(self.all_token_ids)}"
            )
        sampling = self.sampling
        stop_ids = frozenset(sampling.stop_token_ids)
        self.stop_ids = stop_ids if sampling.ignore_eos else stop_ids | self.eos_token_ids
        max_outputs = sampling.max_tokens
        if self.max_model_len is not None:
            max_outputs = min(max_outputs, self.max_model_len - self.num_prompt_tokens)
        self.max_outputs = max_outputs

    @property
    def prompt_token_ids(self) -> TokenView:
        return TokenView(self.all_token_ids, 0, self.num_prompt_tokens)

    @property
    def output_token_ids(self) -> TokenView:
        return TokenView(self.all_token_ids, self.num_prompt_tokens)

    def start_running(self) -> None:
        """Admitted to a step (again, after a preemption: the first time is kept)."""
        self.status = RequestStatus.RUNNING
        self.scheduled_at = self.scheduled_at or time.monotonic()

    def append_output_token(self, token_id: int) -> None:
        """Record one sampled token, or PLACEHOLDER_TOKEN for one a launched step is
        still sampling (`set_output_token` fills it in)."""
        self.all_token_ids.append(token_id)

    def set_output_token(self, position: int, token_id: int) -> None:
        """Fill in the placeholder at `position` (of all_token_ids) with the sampled token."""
        self.all_token_ids[position] = token_id

    def drop_placeholders(self) -> None:
        """Forget tokens still being sampled (preemption: the recompute samples them again,
        and the sampler's randomness depends only on seed and position)."""
        tokens = self.all_token_ids
        while len(tokens) > self.num_prompt_tokens and tokens[-1] == PLACEHOLDER_TOKEN:
            tokens.pop()

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def last_output_token(self) -> int | None:
        """The newest output token (PLACEHOLDER_TOKEN while it is being sampled)."""
        return self.all_token_ids[-1] if self.num_output_tokens else None

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def check_stop(self, num_outputs: int) -> FinishReason | None:
        """Token-level stop rules for output token number `num_outputs` (later outputs may
        still be placeholders when scheduling runs ahead)."""
        if num_outputs <= 0:
            return None
        if self.all_token_ids[self.num_prompt_tokens + num_outputs - 1] in self.stop_ids:
            return FinishReason.STOP
        return self.length_stop(num_outputs)

    def length_stop(self, num_outputs: int) -> FinishReason | None:
        """LENGTH once `num_outputs` outputs reach max_tokens or the model's context."""
        return FinishReason.LENGTH if num_outputs >= self.max_outputs else None
