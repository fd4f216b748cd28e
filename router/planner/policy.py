"""The planning step: a pure function of a snapshot and the planner's own state.

Each pool first gets a proposal of its own (`_propose`), then both are fitted into the
budget together (`_fit_budget`):

* Grow when the fitted load needs more workers, or when the measured target is missed
  while the pool has been settled at its size for a whole window (the model is wrong
  for now: trust the measurement). One worker per interval and a cool-down after each
  change, unless the target is badly missed (then straight to what the load needs).
  Never for a shortage younger than a worker's start-up: an overload that has lasted
  T is as likely as not to last T more, so a worker that takes longer than that to
  start would arrive after the burst has passed.
* Shrink by one worker when one fewer would carry the load at the shrink utilisation,
  nothing is missed, and that has held for a whole cool-down since the last change.
  The loop drains the worker (no request fails).
* The budget counts draining workers too (they hold a device until they leave). When
  both pools want more than it allows, the pool furthest short goes first; a pool that
  can spare a worker gives one up (drained) to a pool that is short at the budget.
* A dead worker being replaced is part of its pool's target, so it is not counted
  twice; while it (or any new worker) starts, measured misses do not add workers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from router.planner.capacity import DecodeSpeed, PrefillSpeed
from router.planner.config import PLANNED_POOLS, PlannerConfig
from router.planner.decision import Action, Decision, PoolDecision
from router.planner.demand import Need, Window, decode_need, prefill_need, prefill_queue_s
from router.planner.snapshot import Snapshot, Traffic

_EWMA = 0.3  # weight of the newest interval in the mean output and context lengths


@dataclass(frozen=True)
class PlannerState:
    """What the planner carries from one step to the next."""

    prefill_speed: PrefillSpeed = field(default_factory=PrefillSpeed)
    decode_speed: DecodeSpeed = field(default_factory=DecodeSpeed)
    recent: tuple[Traffic, ...] = ()  # the window's intervals, oldest first
    output_len: float | None = None  # mean output tokens of completed requests
    context_len: float | None = None  # mean tokens per request in decode batches
    last_at: float | None = None
    last_change: Mapping[str, float] = field(default_factory=dict)
    short_since: Mapping[str, float] = field(default_factory=dict)
    over_since: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class _Proposal:
    target: int
    action: Action
    reason: str


def plan(
    snap: Snapshot, state: PlannerState, config: PlannerConfig
) -> tuple[Decision, PlannerState]:
    """Both pools' sizes for this snapshot, and the state to carry to the next step."""
    state = _learn(snap, state, config)
    window = Window.of(state.recent)
    queue_s = prefill_queue_s(snap, window, state.prefill_speed)
    needs = {
        "prefill": prefill_need(snap, window, state.prefill_speed, queue_s, config),
        "decode": decode_need(
            snap, window, state.decode_speed, state.output_len, state.context_len, queue_s, config
        ),
    }
    proposals = {}
    short_since, over_since = dict(state.short_since), dict(state.over_since)
    for pool in PLANNED_POOLS:
        proposals[pool] = _propose(
            pool, needs[pool], snap, state, config, window.seconds, short_since, over_since
        )
    proposals = _fit_budget(proposals, needs, snap, state, config)
    last_change = dict(state.last_change)
    decisions = []
    for pool in PLANNED_POOLS:
        p, need, current = proposals[pool], needs[pool], snap.pools[pool].target
        if p.target != current:
            last_change[pool] = snap.now
            over_since.pop(pool, None)
            if p.target < current:
                short_since.pop(pool, None)
        decisions.append(
            PoolDecision(pool, current, p.target, p.action, p.reason, need.load, need.detail)
        )
    traffic = (
        f"{window.arrival_rate:.2f} req/s over {window.seconds:.0f} s, "
        f"output {state.output_len or 0:.0f} tokens"
    )
    state = replace(state, last_change=last_change, short_since=short_since, over_since=over_since)
    return Decision(snap.now, tuple(decisions), traffic), state


def _learn(snap: Snapshot, state: PlannerState, config: PlannerConfig) -> PlannerState:
    """Fold the snapshot's samples and traffic into the fits and the window."""
    elapsed = snap.traffic.seconds if state.last_at is None else snap.now - state.last_at
    decay = 0.5 ** (max(elapsed, 0.0) / config.fit_half_life_s)
    t = snap.traffic
    output_len = state.output_len
    if t.num_finished:
        output_len = _ewma(output_len, t.output_tokens / t.num_finished)
    context_len = state.context_len
    batch = sum(s.batch_size for s in snap.decode_samples)
    if batch:
        context_len = _ewma(context_len, sum(s.context_tokens for s in snap.decode_samples) / batch)
    return replace(
        state,
        prefill_speed=state.prefill_speed.updated(snap.prefill_samples, decay),
        decode_speed=state.decode_speed.updated(snap.decode_samples, decay),
        recent=(*state.recent, t)[-config.window_intervals :],
        output_len=output_len,
        context_len=context_len,
        last_at=snap.now,
    )


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else old + _EWMA * (new - old)


def _propose(
    pool: str,
    need: Need,
    snap: Snapshot,
    state: PlannerState,
    config: PlannerConfig,
    window_s: float,
    short_since: dict[str, float],
    over_since: dict[str, float],
) -> _Proposal:
    """One pool's size on its own (the budget comes after); updates the two timers."""
    now, sizes = snap.now, snap.pools[pool]
    current = sizes.target
    low, high = config.minimum(pool), config.maximum(pool)
    if current < low:
        return _Proposal(low, "scale_up", "below_min")
    since_change = now - state.last_change.get(pool, -math.inf)
    want, reason = (need.grow_to, "capacity_short") if need.load is not None else (0, "")
    # A miss measured over a window in which the pool was at its current size, while
    # the model says it is enough: the model is wrong for now, one worker more.
    if need.missed and want <= current:
        if not sizes.settled or since_change < window_s:
            # What was measured is (partly) of another size: measure this one first.
            short_since.pop(pool, None)
            return _Proposal(
                current, "hold", "workers_starting" if not sizes.settled else "cooldown"
            )
        want, reason = current + 1, need.missed
    if want > current:
        over_since.pop(pool, None)
        since = short_since.setdefault(pool, now)
        if current >= high:
            return _Proposal(current, "hold", "at_max")
        startup = snap.startup_s.get(pool) or config.default_startup_s
        if now - since < startup:
            return _Proposal(current, "hold", "burst_shorter_than_startup")
        if since_change < config.cooldown and not need.badly:
            return _Proposal(current, "hold", "cooldown")
        step = want - current if need.badly else 1
        return _Proposal(min(current + step, high), "scale_up", reason)
    short_since.pop(pool, None)
    if need.load is None:
        over_since.pop(pool, None)
        return _Proposal(current, "hold", "no_estimate")
    if need.shrink_to < current and current > low and not need.missed:
        since = over_since.setdefault(pool, now)
        if sizes.starting or sizes.draining or sizes.replacing:
            return _Proposal(current, "hold", "workers_starting")
        if min(now - since, since_change) < config.cooldown:
            return _Proposal(current, "hold", "cooldown")
        return _Proposal(
            current - 1, "scale_down", "idle" if need.load == 0 else "over_provisioned"
        )
    over_since.pop(pool, None)
    return _Proposal(current, "hold", "within_slo")


def _fit_budget(
    proposals: dict[str, _Proposal],
    needs: Mapping[str, Need],
    snap: Snapshot,
    state: PlannerState,
    config: PlannerConfig,
) -> dict[str, _Proposal]:
    """Both proposals within the budget: the pool furthest short first, and a worker
    moved from a pool that can spare one to a pool short at the budget."""
    current = {pool: snap.pools[pool].target for pool in PLANNED_POOLS}
    budget = config.max_workers - sum(snap.pools[pool].draining for pool in PLANNED_POOLS)
    if sum(p.target for p in proposals.values()) <= budget:
        return proposals
    out = dict(proposals)
    granted = {pool: min(p.target, current[pool]) for pool, p in proposals.items()}
    # The pools already hold more than the budget (the budget was lowered, or workers
    # were added by hand): the pool with most to spare gives one up.
    while sum(granted.values()) > budget:
        pool = max(
            (p for p in PLANNED_POOLS if granted[p] > config.minimum(p)),
            key=lambda p: granted[p] - needs[p].grow_to,
            default=None,
        )
        if pool is None:
            break
        granted[pool] -= 1
        out[pool] = _Proposal(granted[pool], "scale_down", "over_budget")
    room = budget - sum(granted.values())
    wanting = {pool for pool, p in proposals.items() if p.target > granted[pool]}
    while room > 0 and wanting:
        pool = max(wanting, key=lambda p: proposals[p].target / max(granted[p], 1))
        granted[pool] += 1
        room -= 1
        if granted[pool] >= proposals[pool].target:
            wanting.discard(pool)
    for pool in wanting:  # short, and the budget is spent
        p = proposals[pool]
        out[pool] = (
            _Proposal(granted[pool], p.action, p.reason)
            if granted[pool] > current[pool]
            else _Proposal(current[pool], "hold", "at_budget")
        )
        other = "decode" if pool == "prefill" else "prefill"
        if out[other].action == "hold" and _can_spare(other, needs[other], snap, state, config):
            out[other] = _Proposal(current[other] - 1, "scale_down", "budget_rebalance")
    return out


def _can_spare(
    pool: str, need: Need, snap: Snapshot, state: PlannerState, config: PlannerConfig
) -> bool:
    """One worker fewer would still carry this pool's load at the target utilisation,
    and its last change is a cool-down old."""
    current = snap.pools[pool].target
    since_change = snap.now - state.last_change.get(pool, -math.inf)
    return (
        need.load is not None
        and not need.missed
        and need.grow_to < current
        and current > config.minimum(pool)
        and snap.pools[pool].settled
        and since_change >= config.cooldown
    )
