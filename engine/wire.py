"""Every type that crosses a process boundary between the router and the workers.

Immutable, typed, plain Python (no torch, no Ray, no protobuf): Ray pickles them
between actors, and both sides import them from here. The engine core produces the
wire types itself, as vLLM's core produces `EngineCoreOutputs`: a step's result is one
`TokenUpdate` per request (a decode worker sends them in a `TokenBatch`), and an
engine's occupancy is its `WorkerStats`, and its speed alone, measured as it warms up,
its `EngineSpeed`. The prefill pool answers with a `PrefillResult`; a hand-off is
addressed by a `HandoffTarget` and filled into a `Reservation`. Where a request's time
went on a worker rides along as a `PhaseReport`; a request's trace context (W3C
`traceparent`/`tracestate`, empty when it is not traced) travels inside its
`GenerationInput`, so a worker's spans join the router's trace (engine/tracing.py).
"""

from __future__ import annotations

import functools
from array import array
from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import NamedTuple

from engine.core.kv_events import KVEvents
from engine.core.request import FinishReason
from engine.sampling_params import SamplingParams

# A worker incarnation's epoch (62 random bits) as it is shown everywhere, logs, spans,
# errors and `pdserve workers` alike: 16 hex digits, leading zeros kept, so one epoch
# reads the same wherever it is grepped for.
EPOCH_HEX_DIGITS = 16


def epoch_hex(epoch: int) -> str:
    """An epoch as fixed-width hex (`06ca…`, never `6ca…`)."""
    return f"{epoch:0{EPOCH_HEX_DIGITS}x}"


class PoolName(StrEnum):
    """A pool's name; a member is its plain string everywhere (logs, labels, the API)."""

    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"


POOLS: tuple[PoolName, ...] = tuple(PoolName)


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
    # The W3C trace-context carrier of the router's span for this attempt; empty when the
    # request is not traced (then workers record no spans for it). Not part of the
    # request's identity.
    trace_context: dict[str, str] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class TPGroupSpec:
    """How the processes of one tensor-parallel worker find each other on their node: a
    file the ranks' process group meets at, and the Unix socket (abstract namespace)
    rank 0 hands each step's plan to the others through, with its key."""

    size: int
    rendezvous_file: str
    step_address: str
    authkey: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if self.size < 2:
            raise ValueError(f"a tensor-parallel group has 2 or more ranks, got {self.size}")


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
    # Leading blocks whose KV is there already (a live move's pre-copy): the sender
    # sends only the blocks after them.
    num_precopied: int = 0

    @property
    def target(self) -> HandoffTarget:
        return HandoffTarget(self.worker_id, self.epoch)


@dataclass(frozen=True)
class PhaseReport:
    """Where one request's time went on one worker, in seconds (None: the phase did not
    run there, or not in this message). The router turns these into its per-worker
    phase histograms; each phase is reported once."""

    queue_s: float | None = None  # waiting in the worker's engine queue for a first step
    compute_s: float | None = None  # its prompt: first step to first token (cached or not)
    transfer_s: float | None = None  # its KV: ready on the sender to in place here
    # Of transfer_s: the sender posting the message's last header (a streamed message's
    # trailer) to this worker reading it (the sending lane, the control channel and the
    # receiving thread's wake-up); the rest is the payload's last bytes landing.
    kv_signal_s: float | None = None
    # Bytes of its KV received in a whole message (0 for a streamed one, whose receive
    # waits on the sender's pass), and its share by bytes of that message's receive
    # time: summed, the time the channel spent receiving, the true bandwidth's divisor.
    wire_bytes: int = 0
    wire_s: float = 0.0
    admission_s: float | None = None  # KV in place to its first decode step scheduled
    first_step_s: float | None = None  # that step scheduled to its token out

    def merged(self, later: PhaseReport) -> PhaseReport:
        """Both reports in one (each phase is set in at most one of them)."""
        values = {
            f.name: getattr(later, f.name) if getattr(later, f.name) else getattr(self, f.name)
            for f in fields(self)
        }
        return PhaseReport(**values)


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
class DetachedMove:
    """A detached request on its way to a peer: its id on the source, the id the target
    reserved blocks under, and what `detach` returned."""

    req_id: str
    as_req_id: str
    detached: DetachedRequest
    skip_blocks: int = 0  # leading blocks the target has from a pre-copy: not sent again


@dataclass(frozen=True)
class Precopy:
    """A running request whose full blocks go to a peer ahead of its move: its id on the
    source and the id the peer will hold them under (the move's new id)."""

    req_id: str
    as_req_id: str


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
    phases: PhaseReport | None = None  # queue and compute on the prefill worker


class TokenUpdate(NamedTuple):
    """One request's news from an engine: new tokens, its KV's arrival, or its end.

    The engine core builds these itself, one per request per step (a NamedTuple: cheap
    to build), and the decode pool sends them to the router as they are.
    """

    req_id: str
    new_token_ids: tuple[int, ...] = ()
    finish_reason: FinishReason | None = None
    num_cached_tokens: int = 0
    # The request left its engine with its blocks still allocated (a prefill engine:
    # they hold the KV to hand off); whoever handles the update must release() them.
    hand_off: bool = False
    error: str = ""  # with finish_reason ERROR: what went wrong on the worker
    # Set once, when the request's KV has arrived: the receive itself, and the whole
    # hand-off from the sender's KV being ready to the KV in place.
    kv_wire_s: float = 0.0
    kv_handoff_s: float = 0.0
    phases: PhaseReport | None = None  # set on arrival and with the first token
    # time.monotonic() on its engine when a step first scheduled it (its queue wait
    # ended): the worker's phase timings read it, the router does not, and it does not
    # cross to the router (a TokenBatch arrives with it at 0.0).
    scheduled_at: float = 0.0


# tuple.__new__ on the class, called from C: the NamedTuple's own __new__ is a Python
# function, and the scheduler builds one update per running request per step.
_new_token_update = functools.partial(tuple.__new__, TokenUpdate)


def sampled_update(
    req_id: str,
    token: int,
    finish_reason: FinishReason | None,
    num_cached_tokens: int,
    hand_off: bool,
    scheduled_at: float,
) -> TokenUpdate:
    """`TokenUpdate(req_id, (token,), finish_reason, num_cached_tokens, hand_off,
    scheduled_at=scheduled_at)`, at less than half its cost: a step's one new token."""
    return _new_token_update(  # type: ignore[no-any-return]
        (
            req_id,
            (token,),
            finish_reason,
            num_cached_tokens,
            hand_off,
            "",
            0.0,
            0.0,
            None,
            scheduled_at,
        )
    )


@dataclass(frozen=True)
class EngineSpeed:
    """What an engine's warm-up measured, alone on its device: one prompt's pass, and one
    decode step of that request (None on a prefill engine, which never decodes).

    A worker reports it as it starts (`WorkerInfo.speed`): the router's load-aware
    estimates start from it, so they hold from the first request, and traffic's own
    measurements replace it as they come.
    """

    num_prompt_tokens: int
    prefill_s: float
    decode_step_s: float | None = None

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 1 or self.prefill_s <= 0:
            raise ValueError(
                f"a warm-up pass needs tokens and time, got {self.num_prompt_tokens} tokens "
                f"in {self.prefill_s} s"
            )

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.num_prompt_tokens / self.prefill_s

    @property
    def prefill_s_per_token(self) -> float:
        return self.prefill_s / self.num_prompt_tokens


@dataclass(frozen=True)
class WorkerStats:
    """Occupancy of one engine's KV cache and scheduler, and its counters since start.

    The engine core reports it (`EngineCore.stats()`), naming itself by its pool and its
    index there; a worker sends it as it is.
    """

    pool: PoolName
    index: int
    num_blocks_total: int
    num_blocks_in_use: int
    num_running: int
    num_waiting: int
    prefix_hit_tokens: int
    prefix_query_tokens: int
    num_preemptions: int = 0  # since this worker started
    # Speculative decoding since this worker started: proposals verified, accepted, and
    # verifications (one per request per verifying step).
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verifications: int = 0

    @property
    def num_blocks_free(self) -> int:
        return self.num_blocks_total - self.num_blocks_in_use

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens a verifying step gave a request on average: its accepted proposals
        plus the one the target sampled after them (0 before any verification)."""
        if not self.spec_verifications:
            return 0.0
        return 1.0 + self.spec_accepted_tokens / self.spec_verifications


@dataclass(frozen=True)
class TokenBatch:
    """Every update of one or more steps, for every request, in one message.

    It crosses the process boundary as columns: the plain updates (tokens, a finish, the
    cached count) as request ids and packed integer arrays, the few that carry more (an
    error, phases, the KV's arrival) as they are. Pickling one object per request per
    poll cost the decode worker about 0.8 ms for 128 requests, time its engine thread
    waited for the interpreter; the columns take a tenth of that. `scheduled_at` stays
    behind (0.0 on arrival): it is the worker's own, and an update that carried it
    would not be plain.
    """

    updates: tuple[TokenUpdate, ...]
    # The worker's prefix-cache changes since the last batch, in order (for routing).
    kv_events: tuple[KVEvents, ...] = ()
    stats: WorkerStats | None = None  # occupancy when the batch left (for routing)

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return _unpack_batch, (*_pack_updates(self.updates), self.kv_events, self.stats)


_FINISH_CODES: tuple[FinishReason | None, ...] = (None, *FinishReason)
_FINISH_CODE = {reason: code for code, reason in enumerate(_FINISH_CODES)}
# The fields after the first four at their defaults: such an update travels as columns
# (all but `scheduled_at`, which does not travel; it is the last field).
_PLAIN_REST = tuple(TokenUpdate._field_defaults[name] for name in TokenUpdate._fields[4:-1])
_PLAIN_END = 4 + len(_PLAIN_REST)
assert TokenUpdate._fields[_PLAIN_END:] == ("scheduled_at",)

_Rich = tuple[tuple[int, TokenUpdate], ...]
_Packed = tuple[tuple[str, ...], "array[int]", "array[int]", bytes, "array[int]", _Rich]


def _pack_updates(updates: tuple[TokenUpdate, ...]) -> _Packed:
    """Request ids, token counts, tokens, finish codes and cached counts of the plain
    updates; every other update as it is, with its position."""
    req_ids: list[str] = []
    counts, tokens, cached = array("q"), array("q"), array("q")
    finishes = bytearray()
    rich: list[tuple[int, TokenUpdate]] = []
    for position, update in enumerate(updates):
        if update[4:_PLAIN_END] != _PLAIN_REST:
            rich.append((position, update._replace(scheduled_at=0.0)))
            continue
        req_ids.append(update.req_id)
        counts.append(len(update.new_token_ids))
        tokens.extend(update.new_token_ids)
        finishes.append(_FINISH_CODE[update.finish_reason])
        cached.append(update.num_cached_tokens)
    return tuple(req_ids), counts, tokens, bytes(finishes), cached, tuple(rich)


def _unpack_batch(
    req_ids: tuple[str, ...],
    counts: array[int],
    tokens: array[int],
    finishes: bytes,
    cached: array[int],
    rich: _Rich,
    kv_events: tuple[KVEvents, ...],
    stats: WorkerStats | None,
) -> TokenBatch:
    updates: list[TokenUpdate] = []
    start = 0
    new, codes, rest = _new_token_update, _FINISH_CODES, (*_PLAIN_REST, 0.0)
    for req_id, count, finish, num_cached in zip(req_ids, counts, finishes, cached, strict=True):
        # The router's loop rebuilds every update: tuple.__new__, not the NamedTuple's
        # Python constructor.
        end = start + count
        updates.append(new((req_id, tuple(tokens[start:end]), codes[finish], num_cached, *rest)))
        start = end
    for position, update in rich:  # in order of position: each lands where it was
        updates.insert(position, update)
    return TokenBatch(tuple(updates), kv_events, stats)


def merge_updates(taken: list[TokenUpdate]) -> TokenUpdate:
    """One request's consecutive updates as one: all their tokens, the last finish, the
    arrival times where set. The caller never merges across an error or past a finish."""
    first = taken[0]
    if len(taken) == 1:
        return first
    # Tokens and at most a finish, the news of every step (a poll that found several
    # steps merges every request's): by index, no generators, no phases to merge.
    tokens, cached = first[1], first[3]
    plain = first[4:_PLAIN_END] == _PLAIN_REST
    for u in taken[1:]:
        tokens += u[1]
        if u[3] > cached:
            cached = u[3]
        plain = plain and u[4:_PLAIN_END] == _PLAIN_REST
    if plain:
        return _new_token_update(  # type: ignore[no-any-return]
            (first[0], tokens, taken[-1][2], cached, *_PLAIN_REST, 0.0)
        )
    return TokenUpdate(
        first.req_id,
        tuple(t for u in taken for t in u.new_token_ids),
        taken[-1].finish_reason,
        max(u.num_cached_tokens for u in taken),
        error=taken[-1].error,
        kv_wire_s=next((u.kv_wire_s for u in reversed(taken) if u.kv_wire_s), 0.0),
        kv_handoff_s=next((u.kv_handoff_s for u in reversed(taken) if u.kv_handoff_s), 0.0),
        phases=_merged_phases(taken),
    )


def _merged_phases(taken: list[TokenUpdate]) -> PhaseReport | None:
    reports = [u.phases for u in taken if u.phases is not None]
    if not reports:
        return None
    merged = reports[0]
    for report in reports[1:]:
        merged = merged.merged(report)
    return merged


def coalesce(updates: list[TokenUpdate]) -> list[TokenUpdate]:
    """Several steps' updates with each request's merged into one, in order of each
    request's first update. An error stands alone (the tokens before it reach the
    client first), and nothing is merged past a finish."""
    if len({u.req_id for u in updates}) == len(updates):
        return list(updates)  # one step's updates: one per request, nothing to merge
    merged: dict[str, list[TokenUpdate]] = {}
    out: list[list[TokenUpdate]] = []
    error = FinishReason.ERROR
    for u in updates:  # fields by index: this visits every request of every step
        run = merged.get(u[0])
        if run is None or run[-1][2] is not None or u[2] is error:
            run = [u]
            merged[u[0]] = run
            out.append(run)
        else:
            run.append(u)
    return [run[0] if len(run) == 1 else merge_updates(run) for run in out]
