"""The planner's Prometheus metrics, on the router's registry (one /metrics endpoint):

* `pdserve_planner_decisions_total{pool, action, reason}`: every planning step's
  decision per pool (holds included, so a rate shows what the planner keeps running
  into: cool-downs, the budget, bursts shorter than a start-up);
* `pdserve_planner_target_workers{pool}`: the size the planner last set;
* `pdserve_planner_load_workers{pool}`: its estimate of the pool's load, in busy workers.
"""

from __future__ import annotations

import weakref

from prometheus_client import CollectorRegistry, Counter, Gauge

from router.planner.config import PLANNED_POOLS
from router.planner.decision import (
    ACTIONS,
    HOLD_REASONS,
    SCALE_DOWN_REASONS,
    SCALE_UP_REASONS,
    Decision,
)

_REASONS_BY_ACTION = {
    "scale_up": SCALE_UP_REASONS,
    "scale_down": SCALE_DOWN_REASONS,
    "hold": HOLD_REASONS,
}


class PlannerMetrics:
    """The planner's series, registered on `registry`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.decisions = Counter(
            "pdserve_planner_decisions",
            "The planner's decisions, per pool and planning step, by action and reason.",
            ["pool", "action", "reason"],
            registry=registry,
        )
        self.target = Gauge(
            "pdserve_planner_target_workers",
            "The pool size the planner last decided.",
            ["pool"],
            registry=registry,
        )
        self.load = Gauge(
            "pdserve_planner_load_workers",
            "The planner's estimate of a pool's load, in busy workers (NaN: not measured yet).",
            ["pool"],
            registry=registry,
        )
        # Every series from the start, so dashboards and rate() see zeros, not gaps.
        for pool in PLANNED_POOLS:
            for action in ACTIONS:
                for reason in _REASONS_BY_ACTION[action]:
                    self.decisions.labels(pool=pool, action=action, reason=reason)

    def record(self, decision: Decision) -> None:
        for d in decision.pools:
            self.decisions.labels(pool=d.pool, action=d.action, reason=d.reason).inc()
            self.target.labels(pool=d.pool).set(d.target)
            self.load.labels(pool=d.pool).set(float("nan") if d.load is None else d.load)


_registered: weakref.WeakKeyDictionary[CollectorRegistry, PlannerMetrics] = (
    weakref.WeakKeyDictionary()
)


def planner_metrics(registry: CollectorRegistry) -> PlannerMetrics:
    """The planner's metrics on `registry` (registered once; a registry refuses twice)."""
    metrics = _registered.get(registry)
    if metrics is None:
        metrics = _registered[registry] = PlannerMetrics(registry)
    return metrics
