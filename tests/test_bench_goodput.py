"""Goodput arithmetic of the GPU suite on synthetic timings: which requests meet an SLO,
the highest rate sustained, the rate search, when a rate is given up, the merged table."""

from __future__ import annotations

import argparse
import time
from typing import Any

import pytest

from bench import suite_goodput
from bench.suite_common import ReqTiming
from bench.suite_goodput import (
    RateSearch,
    aims,
    attainment,
    definitely_missed,
    give_up_when_missed,
    max_rate_sustained,
)
from bench.suite_report import format_goodput, merge


def test_attainment_at_each_tpot_slo_comes_from_the_same_requests() -> None:
    requests = {
        "ok": [True, True, True, True, False],
        "ttft_ms": [200.0, 300.0, 1500.0, 100.0, 100.0],  # the third misses TTFT <= 1 s
        "tpot_ms": [10.0, 20.0, 10.0, 40.0, 10.0],  # the last one failed
    }
    assert attainment(requests, 1000, 15) == 1 / 5
    assert attainment(requests, 1000, 25) == 2 / 5
    assert attainment(requests, 1000, 50) == 3 / 5


def test_a_one_token_answer_has_no_tpot_to_miss() -> None:
    assert attainment({"ok": [True], "ttft_ms": [10.0], "tpot_ms": [None]}, 1000, 15) == 1.0


def test_max_rate_stops_at_the_first_rate_that_misses() -> None:
    points = [
        {"rate": 4.0, "attainment": {"15": 0.95, "50": 1.0}},
        {"rate": 8.0, "attainment": {"15": 0.5, "50": 0.97}},
        {"rate": 16.0, "attainment": {"15": 0.92, "50": 0.91}},  # noise above a miss
    ]
    assert max_rate_sustained(points, "15", 0.9) == (4.0, True)
    assert max_rate_sustained(points, "50", 0.9) == (16.0, False)  # only a lower bound
    assert max_rate_sustained(points[1:], "15", 0.9) == (0.0, True)


def test_each_objective_reads_the_sweep_aimed_at_it() -> None:
    points = [
        # Aimed at 15 ms: the router kept TPOT low and handed everything off.
        {"rate": 8.0, "aimed_tpot_ms": 15.0, "attainment": {"15": 0.95, "50": 1.0}},
        {"rate": 16.0, "aimed_tpot_ms": 15.0, "attainment": {"15": 0.5, "50": 0.6}},
        # Aimed at 50 ms: local prefill let it go further at 50, not at 15.
        {"rate": 8.0, "aimed_tpot_ms": 50.0, "attainment": {"15": 0.5, "50": 1.0}},
        {"rate": 32.0, "aimed_tpot_ms": 50.0, "attainment": {"15": 0.0, "50": 0.93}},
    ]
    assert max_rate_sustained(points, "15", 0.9) == (8.0, True)
    assert max_rate_sustained(points, "50", 0.9) == (32.0, False)
    assert max_rate_sustained(points, "25", 0.9) == (0.0, False)  # no sweep aimed at it


def test_splits_run_once_per_objective_and_colocated_replicas_once() -> None:
    ns = argparse.Namespace(goodput_aim="slo", tpot_slos=[15.0, 25.0, 50.0])
    assert aims("3p1d", ns) == [15.0, 25.0, 50.0]
    assert aims("colocated_x4", ns) == [None]
    ns.goodput_aim = "router-default"
    assert aims("3p1d", ns) == [None]


def test_a_sweep_is_searched_at_its_aim_and_its_points_say_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[float, float, int]] = []

    def fake_point(address: str, geo: Any, ns: Any, rate: float, slo: float, sweep: int) -> dict:
        calls.append((rate, slo, sweep))
        # Met at 15 ms up to 8 req/s, at 50 ms up to 32.
        met = {"15": 1.0 if rate <= 8 else 0.5, "50": 1.0 if rate <= 32 else 0.5}
        return {"rate": rate, "attainment": met, "errors": [], "num_ok": 1}

    monkeypatch.setattr(suite_goodput, "run_point", fake_point)
    ns = argparse.Namespace(
        tpot_slos=[15.0, 50.0],
        goodput_start_rate=4.0,
        goodput_max_rate=128.0,
        goodput_rates=[],
        goodput_min_requests=1,
        goodput_duration=1.0,
        goodput_output_len=8,
        ttft_slo=1.0,
        attainment=0.9,
    )
    points: list[dict] = []
    far = time.perf_counter() + 3600
    assert suite_goodput.run_sweep("1p1d", "addr", None, ns, far, 15.0, 1, points) is None  # type: ignore[arg-type]
    # Searched at 15 ms: 4, 8 met, 16 missed, 12 (the bisection) missed.
    assert calls == [(4.0, 15.0, 1), (8.0, 15.0, 1), (16.0, 15.0, 1), (12.0, 15.0, 1)]
    assert all(p["aimed_tpot_ms"] == 15.0 for p in points)
    calls.clear()
    suite_goodput.run_sweep("colocated_x2", "addr", None, ns, far, None, 0, points)  # type: ignore[arg-type]
    assert [rate for rate, _, _ in calls] == [4.0, 8.0, 16.0, 32.0, 64.0, 48.0]  # at 50 ms
    assert max_rate_sustained(points, "15", 0.9) == (8.0, True)
    assert max_rate_sustained(points, "50", 0.9) == (32.0, True)


def sweep(search: RateSearch, capacity: float) -> list[float]:
    results: dict[float, bool] = {}
    while (rate := search.next_rate(results)) is not None:
        assert rate not in results
        results[rate] = rate <= capacity
    return list(results)


def test_search_doubles_to_the_first_miss_then_bisects_once() -> None:
    assert sweep(RateSearch(start=4, max_rate=128), capacity=20) == [4, 8, 16, 32, 24]
    assert sweep(RateSearch(start=4, max_rate=128), capacity=30) == [4, 8, 16, 32, 24]


def test_search_halves_when_the_first_rate_misses() -> None:
    assert sweep(RateSearch(start=4, max_rate=128), capacity=1.2) == [4, 2, 1, 1.5]
    assert sweep(RateSearch(start=1, max_rate=128, min_rate=0.25), capacity=0.1) == [1, 0.5, 0.25]


def test_search_ends_at_the_max_rate_and_fixed_rates_stop_at_a_miss() -> None:
    assert sweep(RateSearch(start=4, max_rate=20), capacity=100) == [4, 8, 16, 20]
    fixed = RateSearch(start=4, max_rate=128, rates=(2, 4, 8, 16))
    assert sweep(fixed, capacity=5) == [2, 4, 8]


def test_a_request_is_given_up_only_once_it_cannot_meet_the_slo() -> None:
    slo = {"ttft_slo_s": 1.0, "tpot_slo_s": 0.05, "output_len": 11}
    waiting = ReqTiming(sent_s=10.0)
    assert not definitely_missed(waiting, 10.9, **slo)
    assert definitely_missed(waiting, 11.1, **slo)
    slow_first = ReqTiming(sent_s=10.0, first_s=11.5, last_s=11.5, num_tokens=1)
    assert definitely_missed(slow_first, 11.5, **slo)
    decoding = ReqTiming(sent_s=10.0, first_s=10.5, last_s=10.6, num_tokens=3)
    assert not definitely_missed(decoding, 10.9, **slo)  # 0.4 s for 10 tokens: may still meet
    assert definitely_missed(decoding, 11.1, **slo)  # 0.6 s > 10 x 50 ms already
    done = ReqTiming(sent_s=10.0, first_s=10.5, last_s=10.9, num_tokens=11)
    assert not definitely_missed(done, 99.0, **slo)
    assert definitely_missed(ReqTiming(sent_s=10.0, ok=False), 10.0, **slo)


def test_give_up_allows_the_misses_the_attainment_allows() -> None:
    give_up = give_up_when_missed(20, 0.9, 1.0, 0.05, 11)  # 2 misses allowed out of 20
    timings = [ReqTiming(sent_s=1.0) for _ in range(3)] + [ReqTiming(0.0)] * 17  # unsent
    assert not give_up(timings, 1.5)
    assert give_up(timings, 2.5)  # 3 without a first token after 1.5 s
    assert not give_up(timings[1:], 2.5)


def system(name: str, gpus: int, rates: dict[str, float], exact: bool = True) -> dict:
    return {
        "system": name,
        "gpus": gpus,
        "points": [],
        "max_rate": rates,
        "max_rate_exact": {k: exact for k in rates},
    }


def test_table_merges_runs_and_divides_by_the_colocated_system_of_the_same_gpus() -> None:
    workload = {"shape": "8b", "prompt_len": 2048, "output_len": 128}
    slo = {"ttft_s": 1.0, "tpot_ms": [15.0, 50.0], "attainment": 0.9}
    first = {**workload, "slo": slo, "systems": {"3p1d": system("3p1d", 4, {"15": 6, "50": 30})}}
    second = {
        **workload,
        "slo": slo,
        "systems": {"colocated_x4": system("colocated_x4", 4, {"15": 12, "50": 20}, exact=False)},
    }
    (section,) = merge([first, second])
    table = format_goodput(section)
    row = next(line for line in table.splitlines() if line.startswith("3p1d"))
    assert row.split() == ["3p1d", "4", "6", "30", "0.50*", "1.50*"]
    base = next(line for line in table.splitlines() if line.startswith("colocated_x4"))
    assert base.split()[2:4] == [">=12", ">=20"]
