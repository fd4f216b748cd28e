"""The planner against the live pools: every interval, a snapshot of what the router
measured, a decision (`policy.plan`), and the changes applied through `Pools.scale`, the
machinery `pdserve scale` uses (growing starts workers in placement groups of their own,
which wait for a cluster autoscaler where the cluster has one; shrinking drains the
newest workers, so no request fails).

Scaling runs in the background: a pool that is still growing or draining shows its
starting and draining workers in the next snapshot, and the policy accounts for them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from router.fleet.pools import Pools
from router.planner.config import PLANNED_POOLS, PlannerConfig
from router.planner.decision import Decision
from router.planner.metrics import PlannerMetrics
from router.planner.policy import PlannerState, plan
from router.planner.signals import ServingSignals
from router.planner.snapshot import PoolSnapshot, Snapshot
from router.routing.prefill_policy import PrefillPolicyConfig

log = logging.getLogger(__name__)


class ServingCore(Protocol):
    """What the planner reads of the serving core."""

    signals: ServingSignals
    prefill_policy: PrefillPolicyConfig


class PlannerLoop:
    """Runs the planner every `config.interval_s` seconds until stopped."""

    def __init__(
        self,
        config: PlannerConfig,
        pools: Pools,
        core: ServingCore,
        *,
        max_num_seqs: int,
        metrics: PlannerMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.pools = pools
        self.core = core
        self.max_num_seqs = max_num_seqs
        self.metrics = metrics
        self.clock = clock
        self.state = PlannerState()
        self.last: Decision | None = None
        self._said: tuple[tuple[str, str], ...] = ()
        self._task: asyncio.Task[None] | None = None
        self._scaling: set[asyncio.Task[Any]] = set()

    def start(self) -> None:
        self.core.signals.take(self.core.prefill_policy.slo_ttft_ms / 1e3)  # a clean start
        self._task = asyncio.ensure_future(self._run())
        log.info(
            "planner on: %d workers at most (prefill >= %d, decode >= %d), every %g s, "
            "cool-down %g s",
            self.config.max_workers,
            self.config.min_prefill,
            self.config.min_decode,
            self.config.interval_s,
            self.config.cooldown,
        )

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._scaling) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_s)
            try:
                self.step()
            except Exception:  # noqa: BLE001 - one bad step must not end the planner
                log.exception("planner step failed")

    def step(self) -> Decision:
        """One planning step: snapshot, decide, apply, tell."""
        decision, self.state = plan(self.snapshot(), self.state, self.config)
        self.last = decision
        said = tuple((d.action, d.reason) for d in decision.pools)
        # Every decision is logged; one like the last at DEBUG, so a steady state is quiet.
        level = logging.INFO if decision.changes or said != self._said else logging.DEBUG
        log.log(level, "planner: %s", decision.describe())
        self._said = said
        if self.metrics is not None:
            self.metrics.record(decision)
        for change in decision.changes:
            self._start_scaling(change.pool, change.target)
        return decision

    def _start_scaling(self, pool: str, size: int) -> None:
        task = asyncio.ensure_future(self._scale(pool, size))
        self._scaling.add(task)
        task.add_done_callback(self._scaling.discard)

    async def _scale(self, pool: str, size: int) -> None:
        try:
            await self.pools.scale(pool, size)
        except Exception as exc:  # noqa: BLE001 - the next step sees the pool as it is
            log.error("planner: scaling %s to %d failed: %s", pool, size, exc)

    # ---------------------------------------------------------------- the snapshot
    def snapshot(self) -> Snapshot:
        policy = self.core.prefill_policy
        traffic, prefill_samples, decode_samples = self.core.signals.take(policy.slo_ttft_ms / 1e3)
        decode_refs = [w for w in self.pools.workers["decode"] if w.state in ("live", "draining")]
        return Snapshot(
            now=self.clock(),
            pools={pool: self._pool(pool) for pool in PLANNED_POOLS},
            traffic=traffic,
            slo_ttft_s=policy.slo_ttft_ms / 1e3,
            slo_tpot_s=policy.slo_tpot_ms / 1e3,
            prefill_samples=prefill_samples,
            decode_samples=decode_samples,
            startup_s={pool: self.pools.startup_s(pool) for pool in PLANNED_POOLS},
            max_num_seqs=self.max_num_seqs,
            num_blocks=min((w.info.num_blocks for w in decode_refs), default=0),
            block_size=decode_refs[0].info.layout.block_size if decode_refs else 16,
        )

    def _pool(self, pool: str) -> PoolSnapshot:
        refs = self.pools.workers[pool]
        live = [w for w in refs if w.state == "live"]
        stats = [w.load.stats for w in live if w.load.stats is not None]
        return PoolSnapshot(
            target=self.pools.targets[pool],
            live=len(live),
            starting=self.pools.num_starting(pool),
            draining=sum(1 for w in refs if w.state == "draining"),
            queued_tokens=sum(w.load.service_queued_tokens for w in live),
            running=sum(s.num_running for s in stats),
            waiting=sum(s.num_waiting for s in stats),
            kv_usage=max(
                (s.num_blocks_in_use / max(1, s.num_blocks_total) for s in stats), default=0.0
            ),
        )
