"""bench.planner's trace and its report, without a service: the rate doubles, then the
mix switches; attainment and goodput per phase; the planner against the best static."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.planner import PROFILES, make_trace, service_args
from bench.planner_report import attainment_series, phase_stats, plot, table


def test_the_trace_doubles_its_rate_then_switches_its_mix() -> None:
    profile = PROFILES["cpu"]
    trace = make_trace(profile)
    rates = [p["rate"] for p in trace.phases]
    assert rates == [profile.rate, 2 * profile.rate, 2 * profile.rate]
    mixes = [(p["prompt_len"], p["output_len"]) for p in trace.phases]
    assert mixes == [profile.long, profile.long, profile.short]
    counts = [sum(1 for a in trace.arrivals if a[3] == n) for n in range(3)]
    expected = [r * profile.phase_s for r in rates]
    assert all(0.5 * e <= c <= 1.5 * e for c, e in zip(counts, expected, strict=True))
    assert make_trace(profile).arrivals == trace.arrivals  # seeded: every system the same


def test_each_system_runs_with_its_own_split_or_the_planner() -> None:
    profile = PROFILES["gpu"]
    planner = service_args("planner", profile, Path("/m"))
    assert planner[planner.index("--max-gpus") + 1] == "4" and "--prefill-workers" not in planner
    static = service_args("3:1", profile, Path("/m"))
    assert static[static.index("--prefill-workers") + 1] == "3" and "--planner" not in static


def _result() -> dict:
    phases = [
        {"name": f"p{i}", "start_s": 10.0 * i, "end_s": 10.0 * (i + 1), "seconds": 10.0}
        for i in range(2)
    ]
    trace = {"phases": phases, "slo_ttft_ms": 1000, "slo_tpot_ms": 100}
    # (sent, ttft, tpot, ok, phase)
    planner = {
        "requests": [[1, 0.5, 0.05, True, 0], [2, 0.5, 0.05, True, 0], [12, 0.5, 0.05, True, 1]],
        "pools": [[0, 1, 1, 1, 1], [11, 2, 1, 2, 1]],
    }
    static = {
        "requests": [[1, 2.0, 0.05, True, 0], [2, 0.5, 0.05, False, 0], [12, 0.5, 0.2, True, 1]],
        "pools": [[0, 2, 2, 2, 2]],
    }
    return {"trace": trace, "systems": {"planner": planner, "2:2": static}}


def test_attainment_counts_late_and_failed_requests_as_misses() -> None:
    result = _result()
    planner, static = (phase_stats(s, result["trace"]) for s in result["systems"].values())
    assert [p["attainment"] for p in planner] == [1.0, 1.0]
    # Phase 0: one first token too late, one request failed; phase 1: TPOT over target.
    assert [p["attainment"] for p in static] == [0.0, 0.0]
    assert static[0]["num_failed"] == 1 and planner[0]["goodput"] == pytest.approx(0.2)
    assert planner[1]["mean_workers"] == 3 and static[0]["mean_workers"] == 4
    assert attainment_series(result["systems"]["2:2"], result["trace"], 10.0) == [
        (0.0, 0.0),
        (10.0, 0.0),
    ]


def test_the_table_gives_the_planners_goodput_against_the_best_static(tmp_path: Path) -> None:
    result = _result()
    result["systems"]["1:1"] = {"requests": [[1, 0.5, 0.05, True, 0]], "pools": []}
    text = table(result)
    assert "0.0% " in text and "100.0%" in text
    # Phase 0: the planner 2 good requests, the best static (1:1) 1.
    assert "2.00x best static" in text
    pytest.importorskip("matplotlib")
    assert plot(result, tmp_path / "p.png") == tmp_path / "p.png"
    assert (tmp_path / "p.png").stat().st_size > 1000
