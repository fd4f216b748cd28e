"""Every type that crosses a process boundary between the router and the workers.

Frozen, typed, plain Python (no torch, no Ray, no protobuf): Ray pickles them between
actors, and both sides import them from here. One token's path from a decode step to
the router is `TokenUpdate` (inside a `TokenBatch`); the prefill pool answers with a
`PrefillResult`; a hand-off is addressed by a `HandoffTarget` and filled into a
`Reservation`. What a worker reports of itself rides along as `WorkerStats`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from engine.core.kv_events import KVEvents
from engine.core.request import FinishReason
from engine.sampling_params import SamplingParams

PoolName = Literal["prefill", "decode", "colocated"]
POOLS: tuple[PoolName, ...] = ("prefill", "decode", "colocated")


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
class HandoffTarget:
    """Where a request's KV goes: the receiving worker and its incarnation."""

    worker_id: str
    epoch: int


@dataclass(frozen=True)
class Reservation:
    """Blocks a receiving worker holds for one request's incoming KV."""

    worker_id: str
    epoch: int
    block_ids: tuple[int, ...]

    @property
    def target(self) -> HandoffTarget:
        return HandoffTarget(self.worker_id, self.epoch)


@dataclass(frozen=True)
class DetachedRequest:
    """A running request taken off its decode engine to move elsewhere, its KV kept: the
    tokens so far (prompt and outputs) and how many of them the kept KV covers (all but
    the last, which the next step would have computed)."""

    token_ids: tuple[int, ...]
    num_kv_tokens: int

    @property
    def next_token(self) -> int:
        """The token the receiver continues from (sampled, its KV not yet computed)."""
        return self.token_ids[self.num_kv_tokens]


@dataclass(frozen=True)
class PrefillResult:
    """A prefill worker's answer: the first token, and how the request goes on."""

    first_token: int | None
    # None: the KV is on its way to the target, which continues the request. Otherwise
    # the request ended here (STOP/LENGTH on its first token, ABORT, or ERROR with
    # `error`: then nothing was sent and the caller may run it elsewhere).
    finish_reason: FinishReason | None
    num_cached_tokens: int
    prefill_s: float
    transfer_bytes: int = 0  # posted on the channel (arrival is the receiver's to report)
    error: str = ""
    kv_events: tuple[KVEvents, ...] = ()  # this worker's prefix-cache changes, for routing


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
class WorkerStats:
    """Occupancy of one worker's KV cache and scheduler, and its counters since start."""

    pool: PoolName
    index: int
    num_blocks_total: int
    num_blocks_in_use: int
    num_running: int
    num_waiting: int
    prefix_hit_tokens: int
    prefix_query_tokens: int
    num_preemptions: int = 0  # since this worker started

    @property
    def num_blocks_free(self) -> int:
        return self.num_blocks_total - self.num_blocks_in_use


@dataclass(frozen=True)
class TokenBatch:
    """Every update of one or more steps, for every request, in one message."""

    updates: tuple[TokenUpdate, ...]
    # The worker's prefix-cache changes since the last batch, in order (for routing).
    kv_events: tuple[KVEvents, ...] = ()
    stats: WorkerStats | None = None  # occupancy when the batch left (for routing)


def merge_updates(taken: list[TokenUpdate]) -> TokenUpdate:
    """One request's consecutive updates as one: all their tokens, the last finish, the
    arrival times where set. The caller never merges across an error or past a finish."""
    first = taken[0]
    if len(taken) == 1:
        return first
    return TokenUpdate(
        first.req_id,
        tuple(t for u in taken for t in u.new_token_ids),
        taken[-1].finish_reason,
        max(u.num_cached_tokens for u in taken),
        taken[-1].error,
        next((u.kv_wire_s for u in reversed(taken) if u.kv_wire_s), 0.0),
        next((u.kv_handoff_s for u in reversed(taken) if u.kv_handoff_s), 0.0),
    )


def coalesce(updates: list[TokenUpdate]) -> list[TokenUpdate]:
    """Several steps' updates with each request's merged into one, in order of each
    request's first update. An error stands alone (the tokens before it reach the
    client first), and nothing is merged past a finish."""
    merged: dict[str, list[TokenUpdate]] = {}
    out: list[list[TokenUpdate]] = []
    for u in updates:
        run = merged.get(u.req_id)
        if (
            run is None
            or run[-1].finish_reason is not None
            or u.finish_reason is FinishReason.ERROR
        ):
            run = [u]
            merged[u.req_id] = run
            out.append(run)
        else:
            run.append(u)
    return [merge_updates(run) for run in out]
