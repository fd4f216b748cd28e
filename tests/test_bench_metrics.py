"""The serving benchmarks' per-request latency metrics and percentiles."""

from __future__ import annotations

import math

import pytest

from bench.suite_common import ReqTiming, summarize


def test_tpot_is_the_mean_gap_and_itl_keeps_every_gap() -> None:
    timing = ReqTiming(sent_s=0.0)
    for now, count in ((0.1, 1), (0.2, 1), (0.25, 2), (0.75, 1)):
        timing.add_tokens(now, count)
    assert timing.num_tokens == 5
    assert timing.ttft_s == pytest.approx(0.1)
    assert timing.tpot_s == pytest.approx((0.75 - 0.1) / 4)
    assert timing.gaps_s == pytest.approx([0.1, 0.05, 0.5])
    quick = ReqTiming(sent_s=0.0)
    for i in range(1, 12):
        quick.add_tokens(0.01 * i, 1)
    summary = summarize("engine", 2, [timing, quick], wall_s=1.0)
    assert summary["output_tokens"] == 16
    # One long gap lifts the first request's TPOT; most gaps are still 10 ms.
    assert summary["itl_ms"]["p50"] == pytest.approx(10.0)
    assert summary["tpot_ms"]["mean"] == pytest.approx((162.5 + 10.0) / 2)


def test_every_benchmark_reports_the_same_percentiles() -> None:
    """bench.load and the GPU suite give one p50 / p99 for the same samples: linear
    interpolation between ranks (the median of an even count is the middle pair's mean)."""
    from bench.report import distribution, percentile
    from bench.suite_common import dist_ms

    samples_s = [0.010, 0.020, 0.030, 0.040]
    suite = dist_ms(samples_s)
    load = distribution(samples_s, scale=1000)
    assert suite["p50"] == pytest.approx(load["p50"]) == pytest.approx(25.0)
    assert suite["p99"] == pytest.approx(load["p99"]) == pytest.approx(39.7)
    assert math.isnan(percentile([], 50))  # no samples, no number
    with pytest.raises(ValueError, match="percentile"):
        percentile(samples_s, 101)
