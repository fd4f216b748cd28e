"""What the planner decided, and why: one value per planning step, logged, exported as
metrics and shown by `pdserve workers`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Action = Literal["scale_up", "scale_down", "hold"]
ACTIONS: tuple[Action, ...] = ("scale_up", "scale_down", "hold")

# Every reason a pool's decision can give (the metric's label values).
SCALE_UP_REASONS = (
    "below_min",  # the pool is under its --min-*
    "capacity_short",  # the fitted speed says the load needs more workers
    "ttft_missed",  # measured: too few first tokens within the TTFT target
    "tpot_missed",  # measured: too few requests within the TPOT target
    "kv_full",  # requests wait for KV blocks on full decode workers
)
SCALE_DOWN_REASONS = (
    "over_provisioned",  # one worker fewer would carry the load, for a whole cool-down
    "idle",  # no load for a whole cool-down
    "budget_rebalance",  # the other pool needs the worker and this one can spare it
    "over_budget",  # the pools together hold more than the budget
)
HOLD_REASONS = (
    "within_slo",  # the size fits the load
    "no_estimate",  # no speed measured yet and no target missed
    "cooldown",  # changed (or over-provisioned) too recently to change again
    "burst_shorter_than_startup",  # short for less time than a new worker takes to start
    "workers_starting",  # workers are still starting or being replaced: measure them first
    "at_budget",  # short, but the budget is spent and the other pool needs its workers
    "at_max",  # short, at the budget less the other pool's minimum
)
REASONS = SCALE_UP_REASONS + SCALE_DOWN_REASONS + HOLD_REASONS


@dataclass(frozen=True)
class PoolDecision:
    """One pool's size before and after, with the reason and the numbers behind it."""

    pool: str
    current: int
    target: int
    action: Action
    reason: str
    load: float | None  # busy workers' worth of load (None: speed not measured yet)
    detail: str

    def describe(self) -> str:
        size = (
            f"{self.current}" if self.target == self.current else f"{self.current}->{self.target}"
        )
        return f"{self.pool} {size} {self.action} ({self.reason}): {self.detail}"


@dataclass(frozen=True)
class Decision:
    """Both pools' decisions of one planning step."""

    at: float  # the snapshot's time
    pools: tuple[PoolDecision, ...]
    traffic: str  # what was measured, in one line

    def target(self, pool: str) -> int:
        return next(d.target for d in self.pools if d.pool == pool)

    def of(self, pool: str) -> PoolDecision:
        return next(d for d in self.pools if d.pool == pool)

    @property
    def changes(self) -> tuple[PoolDecision, ...]:
        return tuple(d for d in self.pools if d.target != d.current)

    def describe(self) -> str:
        """The decision with its inputs, as logged."""
        return "; ".join([self.traffic, *(d.describe() for d in self.pools)])
