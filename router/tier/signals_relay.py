"""The planner's view of the whole tier's traffic.

The planner runs in the fleet owner, but every router process takes requests: each
records its own traffic (`ServingSignals`: arrivals, prompts placed, first tokens,
completions, prefill replies) and sends what it recorded to the owner every
`REPORT_EVERY_S` (`report_signals`). The owner's planner reads `TierSignals`, which adds
those reports to its own process's record at each interval. Decode step samples are the
owner's alone: every process polls every decode worker, so each would report the same
steps.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from router.planner.signals import ServingSignals
from router.planner.snapshot import DecodeSample, PrefillSample, Traffic
from router.routing.prefill_policy import PrefillPolicyConfig
from router.tier.messages import SignalsReport

REPORT_EVERY_S = 1.0


async def report_signals(core: Any, send: Callable[[Any], None]) -> None:
    """A router process's traffic, to the owner, every REPORT_EVERY_S."""
    while True:
        await asyncio.sleep(REPORT_EVERY_S)
        slo_ttft_s = core.prefill_policy.slo_ttft_ms / 1e3
        traffic, prefill, _decode = core.signals.take(slo_ttft_s)
        send(SignalsReport((traffic, prefill)))


@dataclass
class _Pending:
    """What one process reported since the planner last read."""

    traffic: Traffic | None = None
    prefill: list[PrefillSample] = field(default_factory=list)


def merge_traffic(a: Traffic, b: Traffic) -> Traffic:
    """Two processes' traffic over the same interval (`a`'s length)."""
    return Traffic(
        seconds=a.seconds,
        num_arrivals=a.num_arrivals + b.num_arrivals,
        num_prompts=a.num_prompts + b.num_prompts,
        prompt_tokens=a.prompt_tokens + b.prompt_tokens,
        sum_sq_prompt_tokens=a.sum_sq_prompt_tokens + b.sum_sq_prompt_tokens,
        num_finished=a.num_finished + b.num_finished,
        output_tokens=a.output_tokens + b.output_tokens,
        ttft_s=a.ttft_s + b.ttft_s,
        tpot_s=a.tpot_s + b.tpot_s,
        oldest_waiting_s=max(a.oldest_waiting_s, b.oldest_waiting_s),
        num_waiting_past_ttft=a.num_waiting_past_ttft + b.num_waiting_past_ttft,
    )


def _accumulate(earlier: Traffic, later: Traffic) -> Traffic:
    """One process's two consecutive reports: counts add, the waiting figures are the
    later report's (they describe the requests waiting now)."""
    return replace(
        merge_traffic(earlier, later),
        oldest_waiting_s=later.oldest_waiting_s,
        num_waiting_past_ttft=later.num_waiting_past_ttft,
    )


class TierSignals(ServingSignals):
    """What the owner's planner takes: its own process's signals plus every other
    process's reports since the last take. Only `take` is read through it."""

    def __init__(self, local: ServingSignals) -> None:
        super().__init__()
        self.local = local
        self._pending: dict[int, _Pending] = {}
        self._reports = 0

    def absorb(self, sender: int, report: SignalsReport) -> None:
        traffic, prefill = report.taken
        assert isinstance(traffic, Traffic)
        pending = self._pending.setdefault(sender, _Pending())
        pending.traffic = (
            traffic if pending.traffic is None else _accumulate(pending.traffic, traffic)
        )
        pending.prefill.extend(prefill)  # type: ignore[arg-type]

    def take(
        self, slo_ttft_s: float
    ) -> tuple[Traffic, tuple[PrefillSample, ...], tuple[DecodeSample, ...]]:
        traffic, prefill, decode = self.local.take(slo_ttft_s)
        merged_prefill = list(prefill)
        for pending in self._pending.values():
            if pending.traffic is not None:
                traffic = merge_traffic(traffic, pending.traffic)
            merged_prefill.extend(pending.prefill)
        self._pending.clear()
        return traffic, tuple(merged_prefill), decode


@dataclass
class TierPlannerView:
    """The serving core as the owner's planner reads it: the tier's signals, the owner's
    prefill policy (which the other processes follow)."""

    core: Any
    signals: ServingSignals  # a TierSignals

    @property
    def prefill_policy(self) -> PrefillPolicyConfig:
        policy: PrefillPolicyConfig = self.core.prefill_policy
        return policy

    @prefill_policy.setter
    def prefill_policy(self, policy: PrefillPolicyConfig) -> None:
        self.core.set_prefill_policy(policy)
