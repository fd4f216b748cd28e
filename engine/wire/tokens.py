"""A step's news for each request, and the message that carries many steps' of it.

The engine core produces these itself, as vLLM's core produces `EngineCoreOutputs`: a
step's result is one `TokenUpdate` per request, and a decode worker sends them to the
router in a `TokenBatch`, which crosses the process boundary as columns.
"""

from __future__ import annotations

import functools
from array import array
from dataclasses import dataclass
from typing import NamedTuple

from engine.core.request import FinishReason
from engine.wire.requests import PhaseReport
from engine.wire.workers import KVEvents, WorkerStats


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
