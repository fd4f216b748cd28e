"""The owner's planner reads the whole tier's traffic: its own process's plus every
other process's reports since its last interval."""

from __future__ import annotations

from router.planner.signals import ServingSignals
from router.planner.snapshot import PrefillSample, Traffic
from router.tier.messages import SignalsReport
from router.tier.signals_relay import TierSignals


def test_the_planner_takes_every_processs_traffic_once() -> None:
    local = ServingSignals()
    local.request_arrived("a")
    signals = TierSignals(local)
    first = Traffic(seconds=1.0, num_arrivals=3, ttft_s=(0.1,), oldest_waiting_s=2.0)
    second = Traffic(seconds=1.0, num_arrivals=2, ttft_s=(0.2,), oldest_waiting_s=0.5)
    sample = PrefillSample(1, 100, 10000, 0.05)
    signals.absorb(1, SignalsReport((first, (sample,))))
    signals.absorb(1, SignalsReport((second, ())))
    signals.absorb(2, SignalsReport((Traffic(seconds=1.0, num_arrivals=4), ())))
    traffic, prefill, decode = signals.take(1.0)
    assert traffic.num_arrivals == 1 + 3 + 2 + 4
    assert sorted(traffic.ttft_s) == [0.1, 0.2]
    assert traffic.oldest_waiting_s >= 0.5  # process 1's latest report, not its first
    assert traffic.oldest_waiting_s < 2.0
    assert prefill == (sample,) and decode == ()
    again, _, _ = signals.take(1.0)
    assert again.num_arrivals == 0  # each report counted once
