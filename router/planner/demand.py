"""Each pool's load and how its target fares, from the recent traffic and the fitted speeds.

Load is counted in busy workers: the prefill pool's is the busy time its recent prompts
cost per second; the decode pool's is the output tokens asked for per second over what
one worker gives at the largest batch that keeps the TPOT target (or, when more is
running than that, the running requests over that batch). A pool needs enough workers
to carry its load at a utilisation that leaves room for the tail: for prefill that room
follows from how much of the TTFT target one prompt takes (queueing grows as
ρ/(1−ρ) times a prompt's time), for decode it is the configured target utilisation.

The measured side: the share of first tokens within the TTFT target (requests still
waiting past it count as misses) and of requests within the TPOT target, over the same
window. A target missed while the model says there is enough is a model that is wrong
for now; `policy.py` then trusts the measurement.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from router.planner.capacity import DecodeSpeed, PrefillSpeed
from router.planner.config import PlannerConfig
from router.planner.snapshot import Snapshot, Traffic

MIN_MEASURED = 5  # requests before an attainment counts
KV_FULL = 0.95  # a decode worker's KV usage at which requests wait for blocks


@dataclass(frozen=True)
class Window:
    """The traffic of the last few intervals, added up."""

    seconds: float
    num_arrivals: int
    num_prompts: int
    prompt_tokens: int
    sum_sq_prompt_tokens: int
    num_finished: int
    output_tokens: int
    ttft_s: tuple[float, ...]
    tpot_s: tuple[float, ...]
    oldest_waiting_s: float
    num_waiting_past_ttft: int

    @classmethod
    def of(cls, recent: Sequence[Traffic]) -> Window:
        last = recent[-1]
        return cls(
            seconds=max(sum(t.seconds for t in recent), 1e-9),
            num_arrivals=sum(t.num_arrivals for t in recent),
            num_prompts=sum(t.num_prompts for t in recent),
            prompt_tokens=sum(t.prompt_tokens for t in recent),
            sum_sq_prompt_tokens=sum(t.sum_sq_prompt_tokens for t in recent),
            num_finished=sum(t.num_finished for t in recent),
            output_tokens=sum(t.output_tokens for t in recent),
            ttft_s=tuple(x for t in recent for x in t.ttft_s),
            tpot_s=tuple(x for t in recent for x in t.tpot_s),
            # Still waiting now: only the latest interval knows.
            oldest_waiting_s=last.oldest_waiting_s,
            num_waiting_past_ttft=last.num_waiting_past_ttft,
        )

    @property
    def arrival_rate(self) -> float:
        return self.num_arrivals / self.seconds


@dataclass(frozen=True)
class Attainment:
    """How one target fared over the window."""

    share: float | None  # of requests within it (None: too few measured)
    p90_s: float | None
    num_measured: int

    def missed(self, goal: float) -> bool:
        return self.share is not None and self.share < goal

    def badly_missed(self, target_s: float, factor: float) -> bool:
        return self.p90_s is not None and self.p90_s > factor * target_s


def attainment(samples: Sequence[float], target_s: float, num_late: int = 0) -> Attainment:
    """The share of `samples` within `target_s`, `num_late` more counted as misses."""
    measured = len(samples) + num_late
    if measured < MIN_MEASURED:
        return Attainment(None, None, measured)
    within = sum(1 for s in samples if s <= target_s)
    # Requests still waiting past the target sit at the top of the distribution.
    ordered = sorted(samples) + [math.inf] * num_late
    p90 = ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]
    return Attainment(within / measured, p90, measured)


@dataclass(frozen=True)
class Need:
    """One pool's load and what it asks of the pool's size."""

    pool: str
    load: float | None  # busy workers' worth of work (None: its speed is not known yet)
    grow_to: int  # workers that carry the load at the allowed utilisation
    shrink_to: int  # workers that would carry it at the shrink utilisation
    missed: str | None  # the reason when the measured target is missed
    badly: bool  # missed by more than the configured factor
    detail: str  # the numbers behind it, for the log

    @property
    def short(self) -> bool:
        return self.missed is not None


def _sizes(load: float, utilization: float, shrink_utilization: float) -> tuple[int, int]:
    eps = 1e-9  # a load of exactly 2.0 workers at utilisation 1 needs 2, not 3
    return math.ceil(load / utilization - eps), math.ceil(load / shrink_utilization - eps)


def prefill_utilization(prompt_s: float, slo_ttft_s: float, config: PlannerConfig) -> float:
    """The utilisation at which the queueing before a prompt stays within what the TTFT
    target leaves after the prompt's own time: wait ≈ t·ρ / (2(1−ρ)) (one server, prompts
    of one size) ≤ target − t, i.e. ρ ≤ 2k / (1 + 2k) with k = (target − t) / t."""
    if prompt_s <= 0:
        return config.target_utilization
    slack = (slo_ttft_s - prompt_s) / prompt_s
    if slack <= 0:
        # One prompt alone takes the whole target: more workers cannot meet it, but
        # they still keep the queue from adding to it.
        return config.shrink_utilization
    return max(
        config.shrink_utilization, min(config.target_utilization, 2 * slack / (1 + 2 * slack))
    )


def prefill_queue_s(snap: Snapshot, window: Window, speed: PrefillSpeed) -> float:
    """How long the prompts queued on the prefill pool keep each worker busy, at what a
    token of the recent prompts cost (0 before the speed is measured)."""
    pool = snap.pools["prefill"]
    if window.prompt_tokens:
        busy = speed.busy_s(window.num_prompts, window.prompt_tokens, window.sum_sq_prompt_tokens)
        per_token = (busy or 0.0) / window.prompt_tokens
    else:  # no prompt placed lately: price the queue as prompts of 512 tokens
        per_token = (speed.busy_s(1, 512, 512**2) or 0.0) / 512
    return pool.queued_tokens * per_token / max(pool.live, 1)


def decode_short_of_kv(snap: Snapshot, queue_s: float) -> bool:
    """Requests wait for blocks on full decode workers while the prefill pool's queue is
    short: the decode pool holds them back. (Decode blocks are reserved for prompts still
    queued for prefill too: behind a long prefill queue a full decode cache is the
    prefill pool's shortage, not decode's.)"""
    decode = snap.pools["decode"]
    return decode.waiting > 0 and decode.kv_usage >= KV_FULL and queue_s < snap.slo_ttft_s / 2


def prefill_need(
    snap: Snapshot, window: Window, speed: PrefillSpeed, queue_s: float, config: PlannerConfig
) -> Need:
    pool = snap.pools["prefill"]
    ttft = attainment(window.ttft_s, snap.slo_ttft_s, window.num_waiting_past_ttft)
    busy = speed.busy_s(window.num_prompts, window.prompt_tokens, window.sum_sq_prompt_tokens)
    measured = _measured("TTFT", ttft, snap.slo_ttft_s)
    missed, badly = _judge(ttft, snap.slo_ttft_s, config, "ttft_missed")
    if missed and decode_short_of_kv(snap, queue_s):
        missed, badly = None, False  # the decode pool's miss: decode_need reports it
    if busy is None and not (window.num_arrivals or window.num_prompts or pool.queued_tokens):
        busy = 0.0  # nothing to run: no load, whatever the speed
    if busy is None:
        return Need("prefill", None, 0, 0, missed, badly, f"speed not measured yet; {measured}")
    load = busy / window.seconds
    prompt_s = busy / window.num_prompts if window.num_prompts else 0.0
    rho = prefill_utilization(prompt_s, snap.slo_ttft_s, config)
    rho_shrink = rho * config.shrink_utilization / config.target_utilization
    grow_to, shrink_to = _sizes(load, rho, rho_shrink)
    detail = (
        f"load {load:.2f} workers ({window.num_prompts / window.seconds:.2f} prompts/s of "
        f"{window.prompt_tokens / max(window.num_prompts, 1):.0f} uncached tokens, "
        f"{prompt_s * 1e3:.0f} ms each), utilisation <= {rho:.2f} for TTFT; "
        f"queued {pool.queued_tokens} tokens ({queue_s:.2f} s a worker); {measured}"
    )
    return Need("prefill", load, grow_to, shrink_to, missed, badly, detail)


def decode_need(
    snap: Snapshot,
    window: Window,
    speed: DecodeSpeed,
    output_len: float | None,
    context_len: float | None,
    queue_s: float,
    config: PlannerConfig,
) -> Need:
    pool = snap.pools["decode"]
    tpot = attainment(window.tpot_s, snap.slo_tpot_s)
    measured = _measured("TPOT", tpot, snap.slo_tpot_s)
    missed, badly = _judge(tpot, snap.slo_tpot_s, config, "tpot_missed")
    if decode_short_of_kv(snap, queue_s):
        missed = "kv_full"
        ttft = attainment(window.ttft_s, snap.slo_ttft_s, window.num_waiting_past_ttft)
        badly = badly or ttft.badly_missed(snap.slo_ttft_s, config.badly_missed_factor)
    context = context_len or 0.0
    max_batch = snap.max_num_seqs
    if snap.num_blocks and context > 0:
        max_batch = min(max_batch, int(snap.num_blocks * snap.block_size / context))
    batch = speed.best_batch(snap.slo_tpot_s, context, max(1, max_batch))
    step = speed.step_s(batch, context) if batch is not None else None
    if batch is None and not window.num_arrivals and not pool.running + pool.waiting:
        return Need("decode", 0.0, 0, 0, missed, badly, f"no load; {measured}")
    if batch is None or step is None or step <= 0:
        return Need("decode", None, 0, 0, missed, badly, f"speed not measured yet; {measured}")
    per_worker = batch / step  # output tokens per second within the target
    asked = window.arrival_rate * output_len if output_len is not None else 0.0
    load = max(asked / per_worker, (pool.running + pool.waiting) / batch)
    grow_to, shrink_to = _sizes(load, config.target_utilization, config.shrink_utilization)
    detail = (
        f"load {load:.2f} workers ({window.arrival_rate:.2f} req/s x "
        f"{output_len or 0:.0f} output tokens, {pool.running + pool.waiting} in decode; "
        f"{per_worker:.0f} tokens/s per worker at batch {batch}, step {step * 1e3:.0f} ms, "
        f"context {context:.0f}); {measured}"
    )
    return Need("decode", load, grow_to, shrink_to, missed, badly, detail)


def _judge(
    measured: Attainment, target_s: float, config: PlannerConfig, reason: str
) -> tuple[str | None, bool]:
    if not measured.missed(config.attainment_goal):
        return None, False
    return reason, measured.badly_missed(target_s, config.badly_missed_factor)


def _measured(name: str, a: Attainment, target_s: float) -> str:
    if a.share is None:
        return f"{name}: {a.num_measured} measured"
    return (
        f"{name} p90 {_seconds(a.p90_s)} vs {_seconds(target_s)}, "
        f"{a.share:.0%} of {a.num_measured} within"
    )


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if math.isinf(value):
        return "waiting"
    return f"{value * 1e3:.0f} ms" if value < 1 else f"{value:.2f} s"
