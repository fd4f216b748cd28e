"""Goodput of serving layouts (bench.tp_goodput): layout strings and the serve flags they
map to, which requests meet an SLO and when a probe is given up, the probe search over
several TPOT objectives, the ratios and verdicts, the JSON and its report; one short CPU
run of the whole thing (slow)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, TypedDict

import pytest

from bench import tp_goodput
from bench.goodput import (
    Bracket,
    Layout,
    Pool,
    RateProbeSearch,
    attainment,
    bracket,
    bracket_at,
    comparisons,
    definitely_missed,
    format_tables,
    give_up_when_missed,
    layout_bracket,
    looser_than,
    parse_layout,
    parse_layouts,
    verdict,
)
from bench.report import write_result
from bench.suite_common import ReqTiming
from router.cli.engine_flags import tensor_parallel_size
from router.cli.flag_checks import check_serve_flags, given_flags
from router.cli.flags import build_parser

REPO = Path(__file__).resolve().parents[1]
LLAMA_70B = REPO / "deploy" / "model_configs" / "llama-70b"

# ---------------------------------------------------------------- layouts


def test_layout_strings_name_their_pools_and_gpus() -> None:
    assert parse_layout("colocated:2xtp2") == Layout(Pool(2, 2))
    assert parse_layout("disagg:2xtp1+1xtp2") == Layout(Pool(2, 1), Pool(1, 2))
    assert parse_layout("colocated:2xtp2").gpus == 4
    assert parse_layout("disagg:3xtp1+1xtp1").gpus == 4
    assert parse_layout("disagg:2xtp1+1xtp2").gpus == 4
    assert parse_layout(" disagg:1xtp2+1xtp2 ").name == "disagg:1xtp2+1xtp2"
    assert [x.name for x in parse_layouts("colocated:4xtp1,disagg:2xtp1+2xtp1,")] == [
        "colocated:4xtp1",
        "disagg:2xtp1+2xtp1",
    ]


@pytest.mark.parametrize(
    "text",
    [
        "colocated:2x2",
        "colocated:0xtp1",
        "colocated:1xtp0",
        "disagg:1xtp1",
        "disagg:1xtp1+1xtp1+1xtp1",
        "colocated:1xtp1+1xtp1",
        "3p1d",
        "disagg1xtp1+1xtp1",
    ],
)
def test_a_layout_string_it_cannot_read_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_layout(text)


def test_a_layout_given_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="twice"):
        parse_layouts("colocated:2xtp2,colocated:2xtp2")


@pytest.mark.parametrize(
    "text, pools",
    [
        ("colocated:2xtp2", {"colocated": (2, 2)}),
        ("disagg:1xtp2+1xtp2", {"prefill": (1, 2), "decode": (1, 2)}),
        ("disagg:2xtp1+1xtp2", {"prefill": (2, 1), "decode": (1, 2)}),
        ("disagg:3xtp1+1xtp1", {"prefill": (3, 1), "decode": (1, 1)}),
    ],
)
def test_serve_flags_start_the_pools_the_layout_names(
    text: str, pools: dict[str, tuple[int, int]]
) -> None:
    argv = ["serve", "--model", str(LLAMA_70B), "--metrics-port", "0"]
    argv += parse_layout(text).serve_flags()
    ns = build_parser().parse_args(argv)
    check_serve_flags(ns, given_flags(argv))  # pdserve itself would accept them
    for pool, (workers, tp) in pools.items():
        count = ns.colocated_workers if pool == "colocated" else getattr(ns, f"{pool}_workers")
        assert (count, tensor_parallel_size(ns, pool)) == (workers, tp)
    assert bool(ns.colocated_workers) == ("colocated" in pools)


# ---------------------------------------------------------------- SLO arithmetic


def test_attainment_at_each_tpot_slo_comes_from_the_same_requests() -> None:
    requests: dict[str, list[Any]] = {
        "ok": [True, True, True, True, False],
        "ttft_ms": [200.0, 300.0, 1500.0, 100.0, 100.0],  # the third misses TTFT <= 1 s
        "tpot_ms": [10.0, 20.0, 10.0, 40.0, 10.0],  # the last one failed
    }
    assert attainment(requests, 1000, 15) == 1 / 5
    assert attainment(requests, 1000, 25) == 2 / 5
    assert attainment(requests, 1000, 50) == 3 / 5


def test_a_one_token_answer_has_no_tpot_to_miss() -> None:
    assert attainment({"ok": [True], "ttft_ms": [10.0], "tpot_ms": [None]}, 1000, 15) == 1.0


class _Slo(TypedDict):
    ttft_slo_s: float
    tpot_slo_s: float
    output_len: int


def test_a_request_is_given_up_only_once_it_cannot_meet_the_slo() -> None:
    slo: _Slo = {"ttft_slo_s": 1.0, "tpot_slo_s": 0.05, "output_len": 11}
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


# ---------------------------------------------------------------- the search


def simulate(search: RateProbeSearch, capacity: dict[str, float], cut: bool = True) -> list:
    """Probes against a service that sustains each objective up to its capacity; a
    probe missed at its aim is cut short (its looser objectives unknown)."""
    results: dict[float, dict[str, bool | None]] = {}
    probes = []
    while (probe := search.next_probe(results)) is not None:
        assert probe.rate not in results
        met: dict[str, bool | None] = {k: probe.rate <= c for k, c in capacity.items()}
        if cut and not met[probe.aim]:
            met.update({k: None for k in looser_than(probe.aim, met)})
        results[probe.rate] = met
        probes.append((probe.rate, probe.aim))
    return [probes, {k: bracket_at(results, k) for k in capacity}]


def test_one_sweep_brackets_every_objective_widest_first() -> None:
    search = RateProbeSearch(("25", "50"), {"25": 2.0, "50": 2.0}, max_probes=8)
    probes, brackets = simulate(search, {"25": 3.0, "50": 6.0})
    # Grows at the loosest objective, then bisects whichever bracket is widest.
    assert probes == [
        (2.0, "50"),
        (4.0, "50"),
        (8.0, "50"),
        (5.66, "50"),
        (2.83, "25"),
        (6.73, "50"),
        (3.36, "25"),
    ]
    assert brackets == {"25": Bracket(2.83, 3.36), "50": Bracket(5.66, 6.73)}
    assert all(b.width <= 1.2 for b in brackets.values())


def test_the_search_stops_at_max_probes_and_below_the_min_rate() -> None:
    short = RateProbeSearch(("25",), {"25": 5.0}, growth=1.5, max_probes=3)
    assert simulate(short, {"25": 6.5})[0] == [(5.0, "25"), (7.5, "25"), (6.12, "25")]
    never = RateProbeSearch(("25",), {"25": 2.0}, min_rate=0.5)
    probes, brackets = simulate(never, {"25": 0.1})
    assert [rate for rate, _ in probes] == [2.0, 1.0, 0.5]
    assert brackets["25"] == Bracket(0.0, 0.5)  # goodput 0, known down to 0.5 req/s


def test_a_probe_cut_short_is_not_read_at_looser_objectives() -> None:
    search = RateProbeSearch(("25", "50"), {"25": 4.0, "50": 4.0})
    results: dict[float, dict[str, bool | None]] = {4.0: {"25": False, "50": None}}
    probe = search.next_probe(results)
    assert probe is not None and probe.aim == "50"
    assert probe.rate == 4.2  # not the same rate again: fresh prompts
    assert looser_than("25", ["15", "25", "50"]) == ["50"]


def test_a_grid_of_rates_is_all_the_search_probes() -> None:
    grid = (1.0, 2.0, 4.0, 6.0, 8.0, 12.0, 16.0)
    search = RateProbeSearch(("25", "50"), {"25": 2.5, "50": 2.5}, grid=grid, max_probes=8)
    probes, brackets = simulate(search, {"25": 3.0, "50": 9.0})
    assert {rate for rate, _ in probes} <= set(grid)
    assert brackets == {"25": Bracket(2.0, 4.0), "50": Bracket(8.0, 12.0)}


def test_a_rate_sustained_above_a_missed_one_is_noise() -> None:
    assert bracket([(4.0, True), (8.0, False), (12.0, True)]) == Bracket(4.0, 8.0)
    assert bracket([]) == Bracket(0.0, None)
    assert Bracket(4.0, None).width == float("inf")


# ---------------------------------------------------------------- sweeps


def ns_for(**over: Any) -> argparse.Namespace:
    base: dict[str, Any] = dict(
        slos=[25.0, 50.0],
        attainment=0.9,
        start_rate=2.0,
        resolution=1.2,
        min_rate=0.25,
        max_rate=256.0,
        max_probes=5,
        rates=(),
        probe_s=1.0,
        min_requests=1,
        prompt_len=16,
        output_len=8,
        slo_ttft_ms=1000.0,
    )
    return argparse.Namespace(**{**base, **over})


def test_each_layout_kind_gets_its_sweeps() -> None:
    colocated, disagg = parse_layout("colocated:2xtp2"), parse_layout("disagg:1xtp2+1xtp2")
    assert tp_goodput.sweeps(colocated, "per-slo", [25.0, 50.0]) == [(None, ["25", "50"])]
    assert tp_goodput.sweeps(disagg, "per-slo", [25.0, 50.0]) == [(25.0, ["25"]), (50.0, ["50"])]
    assert tp_goodput.sweeps(disagg, "tightest", [25.0, 50.0]) == [(25.0, ["25", "50"])]
    assert tp_goodput.sweeps(disagg, "router-default", [25.0]) == [(None, ["25"])]


def test_a_sweep_cut_short_keeps_only_what_it_saw(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[float, float, int]] = []

    def fake_point(address: str, geo: Any, ns: Any, rate: float, slo: float, sweep: int) -> dict:
        calls.append((rate, slo, sweep))
        assert (ns.probe_s, ns.slo_ttft_ms, ns.slos) == (1.0, 1000.0, [25.0, 50.0])
        ok25, ok50 = rate <= 3, rate <= 6
        gave_up = not (ok25 if slo == 25 else ok50)
        attainment = {"25": 1.0 if ok25 else 0.2, "50": 1.0 if ok50 else 0.2}
        return {
            "rate": rate,
            "attainment": attainment,
            "gave_up": gave_up,
            "errors": ["not sent: gave up"] if gave_up else [],
            "num_ok": 1,
            "num_requests": 2,
        }

    monkeypatch.setattr(tp_goodput, "run_point", fake_point)
    points: list[dict] = []
    ns = ns_for(max_probes=4)
    far = 1e12
    assert tp_goodput.run_sweep("a", None, ns, ["25", "50"], {}, 0, far, "x", points) is None
    assert calls == [(2.0, 50.0, 0), (4.0, 50.0, 0), (8.0, 50.0, 0), (5.66, 50.0, 0)]
    assert points[2]["attainment"] == {"25": 0.2, "50": 0.2}  # cut short at the loosest
    assert all(p["counts_for"] == ["25", "50"] for p in points)
    # Aimed at 25 ms, cut short there: the 50 ms result of that rate is unknown.
    points.clear()
    calls.clear()
    tp_goodput.run_sweep("a", None, ns_for(max_probes=2), ["25"], {"25": 4.0}, 1, far, "x", points)
    assert calls == [(4.0, 25.0, 1), (2.67, 25.0, 1)]
    assert points[0]["attainment"] == {"25": 0.2, "50": None}
    assert layout_bracket(points, "25", 0.9) == Bracket(2.67, 4.0)
    assert layout_bracket(points, "50", 0.9) == Bracket()  # the sweep did not count for 50
    # A probe that would overrun the deadline is not run.
    assert "time budget" in str(tp_goodput.run_sweep("a", None, ns, ["25"], {}, 2, 0.0, "x", []))


def test_seeds_come_from_earlier_layouts_and_earlier_sweeps() -> None:
    earlier: list[dict[str, Any]] = [
        {"goodput": {"25": {"sustained": 3.0}, "50": {"sustained": 0.0}}},
        {"goodput": {"25": {"sustained": 5.0}}},
        {"skipped": "time budget"},
    ]
    points = [
        {"rate": 4.0, "attainment": {"25": 0.5, "50": 1.0}, "counts_for": ["25"]},
        {"rate": 8.0, "attainment": {"25": 0.1, "50": None}, "counts_for": ["25"]},
    ]
    seeds = tp_goodput.seed_rates(earlier, points, ["25", "50", "100"], 0.9)
    assert seeds == {"25": 5.0, "50": 4.0}


def test_release_waits_for_the_processes_and_kills_those_left() -> None:
    quick = subprocess.Popen([sys.executable, "-c", "pass"])
    stuck = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    quick.wait()
    out = tp_goodput.release({quick.pid, stuck.pid}, on_cuda=False, timeout_s=0.5)
    assert stuck.wait(timeout=10) != 0
    assert out["processes"] == 2 and out["processes_killed"] == 1


# ---------------------------------------------------------------- ratios and report


def record(name: str, **brackets: tuple[float, float | None]) -> dict[str, Any]:
    layout = parse_layout(name)
    return {
        "layout": name,
        "gpus": layout.gpus,
        "disaggregated": layout.disaggregated,
        "startup_s": 60.0,
        "points": [{}] * 3,
        "goodput": {
            k: {"sustained": s, "failed": f, "probes": 3} for k, (s, f) in brackets.items()
        },
    }


RUN = [
    record("colocated:2xtp2", **{"25": (2.0, 2.5), "50": (4.0, 5.0)}),
    record("disagg:1xtp2+1xtp2", **{"25": (3.0, 3.5), "50": (4.5, None)}),
    record("colocated:4xtp1", **{"25": (2.4, 3.0), "50": (8.0, 10.0)}),
    record("disagg:3xtp1+1xtp1", **{"25": (2.0, 2.4), "50": (6.0, 7.0)}),
    {"layout": "disagg:2xtp1+1xtp2", "gpus": 4, "disaggregated": True, "skipped": "time budget"},
    record("disagg:1xtp1+1xtp1", **{"25": (1.0, None)}),  # no colocated layout of 2 GPUs
]


def test_verdicts_read_both_brackets() -> None:
    assert verdict(Bracket(3.0, 3.5), Bracket(2.0, 2.5)) == "better"
    assert verdict(Bracket(2.0, 2.4), Bracket(2.4, 3.0)) == "worse"
    assert verdict(Bracket(4.5, None), Bracket(4.0, 5.0)) == "tied"
    assert verdict(Bracket(0.0, 1.0), Bracket(0.0, 1.0)) == "tied"


def test_comparisons_give_the_pairs_the_best_and_the_never_worse_rule() -> None:
    comp = comparisons(RUN, ["25", "50"])
    pair = comp["pairs"][0]
    # (a): 1P1D of TP 2 ÷ 2 colocated TP-2 workers, at each objective.
    assert pair["disagg"] == "disagg:1xtp2+1xtp2" and pair["colocated"] == "colocated:2xtp2"
    assert pair["25"] == {"ratio": 1.5, "verdict": "better"}
    assert pair["50"] == {"ratio": 1.125, "verdict": "tied"}
    assert len(comp["pairs"]) == 2 * 2  # the skipped layout and the 2-GPU one have none
    # (b): the best of each kind on 4 GPUs.
    best = {row["slo_tpot_ms"]: row for row in comp["best"]}
    assert (best["25"]["disagg"], best["25"]["colocated"]) == (
        "disagg:1xtp2+1xtp2",
        "colocated:4xtp1",
    )
    assert best["25"]["25"]["ratio"] == 1.25
    assert (best["50"]["disagg"], best["50"]["colocated"]) == (
        "disagg:3xtp1+1xtp1",
        "colocated:4xtp1",
    )
    assert best["50"]["50"] == {"ratio": 0.75, "verdict": "worse"}
    # (c): each disaggregated layout against the best colocated one of its GPUs.
    rule = {row["disagg"]: row for row in comp["never_worse"]}
    # Below 4xtp1's 8 req/s at 50 ms, but it missed no rate: not known to be worse.
    assert rule["disagg:1xtp2+1xtp2"]["50"] == {
        "vs": "colocated:4xtp1",
        "ratio": 0.562,
        "verdict": "tied",
    }
    assert rule["disagg:1xtp2+1xtp2"]["25"]["verdict"] == "better"
    assert rule["disagg:1xtp2+1xtp2"]["holds"] is True
    assert rule["disagg:3xtp1+1xtp1"]["holds"] is False
    assert rule["disagg:1xtp1+1xtp1"]["holds"] is None  # nothing to compare with


def test_tables_show_brackets_ratios_and_skips() -> None:
    keys = ["25", "50"]
    text = format_tables(RUN, keys, comparisons(RUN, keys))
    row = next(line for line in text.splitlines() if line.startswith("disagg:1xtp2+1xtp2 "))
    assert row.split()[1:] == ["4", "60.0", "3", "3", "(<3.5)", "4.5", "(+)"]
    assert "disagg:2xtp1+1xtp2" in text and "time budget" in text
    assert "disagg:1xtp2+1xtp2 ÷ colocated:2xtp2" in text
    assert "4 GPUs, TPOT<=50ms: disagg:3xtp1+1xtp1 ÷ colocated:4xtp1 = 0.75 worse" in text


def test_a_run_written_can_be_reported_again_merged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    write_result(first, "bench.tp_goodput", [], config={"slos": [25.0]}, layouts=RUN[:2])
    write_result(second, "bench.tp_goodput", [], config={"slos": [25.0, 50.0]}, layouts=RUN[2:])
    assert json.loads(first.read_text())["provenance"]["command"] == "python -m bench.tp_goodput"
    assert tp_goodput.main(["--report", str(first), str(second)]) == 0
    text = capsys.readouterr().out
    assert "TPOT<=50ms" in text and "disagg:3xtp1+1xtp1 ÷ colocated:4xtp1" in text


def test_quick_defaults_and_bad_flags() -> None:
    ns = tp_goodput.parse_args(["--quick"])
    assert isinstance(tp_goodput.QUICK_LAYOUTS, str)
    assert [x.name for x in ns.layouts] == tp_goodput.QUICK_LAYOUTS.split(",")
    assert (ns.model_config, ns.prompt_len, ns.slos) == ("tiny", 64, [50.0, 200.0])
    ns = tp_goodput.parse_args(["--slo-tpot-ms", "50,25", "--rates", "4,1,2"])
    assert (ns.slos, ns.rates, ns.prompt_len, ns.output_len) == (
        [25.0, 50.0],
        (1.0, 2.0, 4.0),
        2048,
        128,
    )
    with pytest.raises(SystemExit):
        tp_goodput.parse_args(["--layouts", "colocated:2tp2"])


# ---------------------------------------------------------------- a real run (CPU)


@pytest.mark.e2e
@pytest.mark.slow
def test_a_short_cpu_run_measures_every_layout_and_frees_it(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    argv = ["--quick", "--layouts", "colocated:1xtp2,disagg:1xtp1+1xtp1", "--slo-tpot-ms", "200"]
    argv += ["--out", str(out), "--workdir", str(tmp_path / "logs")]
    assert tp_goodput.main(argv) == 0
    data = json.loads(out.read_text())
    assert [r["layout"] for r in data["layouts"]] == ["colocated:1xtp2", "disagg:1xtp1+1xtp1"]
    for r in data["layouts"]:
        assert r["exit_code"] == 0 and r["release"]["processes_killed"] == 0
        assert r["goodput"]["200"]["sustained"] > 0
    assert data["comparisons"]["pairs"][0]["colocated"] == "colocated:1xtp2"
    assert "colocated:1xtp2" in data["tables"]
