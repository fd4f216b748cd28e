"""A fluid model of the two pools, interval by interval, for the planner's unit tests.

Requests arrive (Poisson, optionally with a noisy rate), prefill workers serve prompts
at a true speed the planner never sees except through samples (with noise), decode
workers run batches whose size follows from Little's law, and the pools' workers start,
drain and die on a clock. Each interval yields the `Snapshot` the router would take,
and the planner's decision is applied to the simulated pools.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from router.planner.config import PLANNED_POOLS, PlannerConfig
from router.planner.decision import Decision
from router.planner.policy import PlannerState, plan
from router.planner.snapshot import (
    DecodeSample,
    PoolSnapshot,
    PrefillSample,
    Snapshot,
    Traffic,
)

SLO_TTFT_S = 1.0
SLO_TPOT_S = 0.05
MAX_NUM_SEQS = 128


@dataclass(frozen=True)
class Phase:
    seconds: float
    rate: float  # requests per second
    prompt_len: int
    output_len: int


@dataclass(frozen=True)
class TrueSpeed:
    """What one worker really does (the planner only sees noisy samples of it)."""

    prompt_s: float = 0.002  # per prompt
    token_s: float = 5e-5  # per prompt token: 20 k tokens/s
    step_fixed_s: float = 0.010
    step_per_request_s: float = 2e-4
    step_per_context_token_s: float = 1e-8

    def prefill_s(self, tokens: int) -> float:
        return self.prompt_s + self.token_s * tokens

    def step_s(self, batch: float, context: float) -> float:
        return (
            self.step_fixed_s
            + self.step_per_request_s * batch
            + self.step_per_context_token_s * batch * context
        )


@dataclass
class _Pool:
    target: int
    live: int
    starting: list[float] = field(default_factory=list)  # when each becomes live
    draining: list[float] = field(default_factory=list)  # when each leaves
    restarts: list[float] = field(default_factory=list)  # when each replacement starts


@dataclass
class Sim:
    config: PlannerConfig
    interval_s: float = 5.0
    startup_s: float = 30.0
    drain_s: float = 5.0
    noise: float = 0.0  # the arrival rate varies by up to this share each interval
    speed: TrueSpeed = field(default_factory=TrueSpeed)
    seed: int = 0
    prefill: int = 1
    decode: int = 1
    now: float = 0.0
    state: PlannerState = field(default_factory=PlannerState)
    decisions: list[Decision] = field(default_factory=list)
    pools: dict[str, _Pool] = field(init=False)
    backlog_s: float = field(init=False, default=0.0)  # prefill work queued, seconds

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.pools = {
            "prefill": _Pool(self.prefill, self.prefill),
            "decode": _Pool(self.decode, self.decode),
        }

    # ---------------------------------------------------------------- the pools' clock
    def _tick(self) -> None:
        for pool in self.pools.values():
            pool.starting += [t + self.startup_s for t in pool.restarts if t <= self.now]
            pool.restarts = [t for t in pool.restarts if t > self.now]
            arrived = [t for t in pool.starting if t <= self.now]
            pool.starting = [t for t in pool.starting if t > self.now]
            pool.live += len(arrived)
            pool.draining = [t for t in pool.draining if t > self.now]

    def kill(self, pool: str, backoff_s: float = 12.0) -> None:
        """A worker dies; the router starts its replacement (same target) after a
        back-off, during which the pool is short of a worker that is not starting yet."""
        self.pools[pool].live -= 1
        self.pools[pool].restarts.append(self.now + backoff_s)

    def _apply(self, decision: Decision) -> None:
        for d in decision.pools:
            pool = self.pools[d.pool]
            if d.target > pool.target:
                pool.starting += [self.now + self.startup_s] * (d.target - pool.target)
            elif d.target < pool.target:
                leaving = d.target - pool.target
                pool.live += leaving
                pool.draining += [self.now + self.drain_s] * -leaving
            pool.target = d.target

    def sizes(self) -> dict[str, int]:
        return {name: pool.target for name, pool in self.pools.items()}

    # ---------------------------------------------------------------- one interval
    def step(self, phase: Phase) -> Decision:
        self.now += self.interval_s
        self._tick()
        snap = self._snapshot(phase)
        decision, self.state = plan(snap, self.state, self.config)
        self.decisions.append(decision)
        self._apply(decision)
        return decision

    def run(self, phase: Phase) -> list[Decision]:
        return [self.step(phase) for _ in range(round(phase.seconds / self.interval_s))]

    def _jitter(self, value: float, share: float = 0.05) -> float:
        return value * (1 + self.rng.uniform(-share, share))

    def _snapshot(self, phase: Phase) -> Snapshot:
        dt, rng = self.interval_s, self.rng
        rate = phase.rate * (1 + rng.uniform(-self.noise, self.noise))
        n = _poisson(rng, rate * dt)
        length, out = phase.prompt_len, phase.output_len
        prefill, decode = self.pools["prefill"], self.pools["decode"]

        # Prefill: work in worker-seconds against the live workers' time.
        t_prompt = self.speed.prefill_s(length)
        capacity = max(prefill.live, 0) * dt
        work = n * t_prompt + self.backlog_s
        done = min(work, capacity)
        self.backlog_s = work - done
        rho = min(done / capacity, 0.999) if capacity else 0.999
        wait = t_prompt * rho / (2 * (1 - rho)) + self.backlog_s / max(prefill.live, 1)
        ttft = tuple(self._jitter(t_prompt + wait, 0.1) for _ in range(n))
        waiting_past = 0
        if self.backlog_s / max(prefill.live, 1) > SLO_TTFT_S:
            waiting_past = int(self.backlog_s / t_prompt)
        processed = min(n, 40)
        prefill_samples = tuple(
            PrefillSample(1, length, length * length, self._jitter(t_prompt))
            for _ in range(processed)
        )

        # Decode: each live worker's batch from Little's law, B = λ·O·step(B) / N.
        context = length + out / 2
        per_worker = rate * out / max(decode.live, 1)  # tokens/s asked of each worker
        per_request = self.speed.step_per_request_s + self.speed.step_per_context_token_s * context
        denominator = 1 - per_worker * per_request
        batch = (
            MAX_NUM_SEQS if denominator <= 0 else per_worker * self.speed.step_fixed_s / denominator
        )
        waiting = 0
        if batch > MAX_NUM_SEQS:
            waiting = int((batch - MAX_NUM_SEQS) * decode.live)
            batch = MAX_NUM_SEQS
        step = self.speed.step_s(batch, context)
        tpot = tuple(self._jitter(step, 0.1) for _ in range(n))
        decode_samples = tuple(
            DecodeSample(
                max(1, round(b)),
                round(max(1, round(b)) * context),
                self._jitter(self.speed.step_s(max(1, round(b)), context)),
            )
            for b in (batch * self._jitter(1.0, 0.5) for _ in range(10 * max(decode.live, 1)))
        )
        traffic = Traffic(
            seconds=dt,
            num_arrivals=n,
            num_prompts=n,
            prompt_tokens=n * length,
            sum_sq_prompt_tokens=n * length * length,
            num_finished=n,
            output_tokens=n * out,
            ttft_s=ttft,
            tpot_s=tpot,
            oldest_waiting_s=wait if self.backlog_s else 0.0,
            num_waiting_past_ttft=waiting_past,
        )
        pools = {
            name: PoolSnapshot(
                target=p.target,
                live=p.live,
                starting=len(p.starting),
                draining=len(p.draining),
                queued_tokens=int(self.backlog_s / t_prompt * length) if name == "prefill" else 0,
                running=round(batch * decode.live) if name == "decode" else 0,
                waiting=waiting if name == "decode" else 0,
                kv_usage=0.5,
            )
            for name, p in self.pools.items()
        }
        return Snapshot(
            now=self.now,
            pools=pools,
            traffic=traffic,
            slo_ttft_s=SLO_TTFT_S,
            slo_tpot_s=SLO_TPOT_S,
            prefill_samples=prefill_samples,
            decode_samples=decode_samples,
            startup_s={pool: self.startup_s for pool in PLANNED_POOLS},
            max_num_seqs=MAX_NUM_SEQS,
        )


def _poisson(rng: random.Random, mean: float) -> int:
    """A Poisson draw (Knuth's method for small means, normal beyond)."""
    if mean > 50:
        return max(0, round(rng.gauss(mean, math.sqrt(mean))))
    limit, k, p = math.exp(-mean), 0, 1.0
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1
