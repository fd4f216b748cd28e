"""The planner's settings: the worker budget, each pool's floor, and how it paces changes."""

from __future__ import annotations

from dataclasses import dataclass

PLANNED_POOLS = ("prefill", "decode")
DEFAULT_INTERVAL_S = 10.0


@dataclass(frozen=True)
class PlannerConfig:
    """What `pdserve serve --planner` was given, plus the pacing it derives."""

    max_workers: int  # across both pools (one GPU each on GPU machines)
    min_prefill: int = 1
    min_decode: int = 1
    interval_s: float = DEFAULT_INTERVAL_S
    # After a pool changes, it does not change again for this long unless a target is
    # badly missed; a pool shrinks only after this long over-provisioned. None: 3 intervals.
    cooldown_s: float | None = None
    # The share of a pool's capacity it may be loaded to (the rest absorbs bursts and
    # keeps the tail within the targets); a pool shrinks only when one worker fewer
    # would stay under `shrink_utilization`, so a load between the two moves nothing.
    target_utilization: float = 0.8
    shrink_utilization: float = 0.55
    # A target is met when this share of requests meets it (measured over the window);
    # badly missed when its 90th percentile is over `badly_missed_factor` times it.
    attainment_goal: float = 0.9
    badly_missed_factor: float = 2.0
    # Traffic is averaged over this many intervals; the speed fits forget with this half-life.
    window_intervals: int = 3
    fit_half_life_s: float = 120.0
    # A worker's start-up before one was measured (the initial pools' start is measured).
    default_startup_s: float = 60.0

    def __post_init__(self) -> None:
        if self.min_prefill < 1 or self.min_decode < 1:
            raise ValueError("each pool needs at least one worker (min_prefill, min_decode >= 1)")
        if self.min_prefill + self.min_decode > self.max_workers:
            raise ValueError(
                f"the minimums ({self.min_prefill} prefill + {self.min_decode} decode) "
                f"exceed the budget of {self.max_workers} workers"
            )
        if self.interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {self.interval_s}")
        if self.cooldown_s is not None and self.cooldown_s < 0:
            raise ValueError(f"cooldown_s must be >= 0, got {self.cooldown_s}")
        if not 0 < self.shrink_utilization < self.target_utilization <= 1:
            raise ValueError("need 0 < shrink_utilization < target_utilization <= 1")
        if not 0 < self.attainment_goal <= 1:
            raise ValueError("attainment_goal must be in (0, 1]")
        if self.badly_missed_factor <= 1:
            raise ValueError("badly_missed_factor must be > 1")
        if self.window_intervals < 1:
            raise ValueError("window_intervals must be >= 1")

    @property
    def cooldown(self) -> float:
        """Seconds a pool holds after a change."""
        return 3 * self.interval_s if self.cooldown_s is None else self.cooldown_s

    def minimum(self, pool: str) -> int:
        return self.min_prefill if pool == "prefill" else self.min_decode

    def maximum(self, pool: str) -> int:
        """The most one pool can have: the budget less the other pool's floor."""
        other = "decode" if pool == "prefill" else "prefill"
        return self.max_workers - self.minimum(other)
