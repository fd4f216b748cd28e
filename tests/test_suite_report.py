"""bench.suite_report's table of one request at a time: the 1P1D row carries the
router's own TTFT and the prefill worker's time beside the client's, so a GPU run shows
where the service's time before the first token went."""

from __future__ import annotations

from typing import Any

from bench.suite_report import _ttft_c1


def run(system: str, ttft: float, **extra: dict[str, Any]) -> dict:
    return {"system": system, "concurrency": 1, "rounds": 1, "prompt_len": 512,
            "ttft_ms": {"p50": ttft}, **extra}  # fmt: skip


def test_the_1p1d_row_splits_its_ttft_into_router_and_worker() -> None:
    shapes = {
        "1b": {
            "offline": {"b": {"runs": [run("b", 14.0)]}},
            "colocated": {"runs": [run("cc", 20.0)]},
            "service": {
                "runs": [
                    run("c", 21.0, router_ttft_ms={"p50": 19.5}, worker_prefill_ms={"p50": 17.25})
                ]
            },
        }
    }
    header, row = _ttft_c1(shapes, 512)[-2:]
    assert header.split()[-4:] == ["c", "rtr", "c", "wkr"]
    cells = row.split()
    assert cells[:5] == ["1b", "512", "14.00", "20.00", "21.00"]
    assert cells[-2:] == ["19.50", "17.25"]


def test_a_run_from_before_the_split_shows_dashes() -> None:
    shapes = {"1b": {"service": {"runs": [run("c", 21.0)]}}}
    row = _ttft_c1(shapes, 512)[-1]
    assert row.split()[-2:] == ["-", "-"]


def test_phase_means_come_from_the_histograms_between_two_scrapes() -> None:
    from bench.harness.metrics import phase_means_ms

    def hist(family: str, pool: str, worker: str, total: float, count: float) -> dict:
        labels = frozenset({"pool": pool, "worker": worker}.items())
        return {(f"{family}_sum", labels): total, (f"{family}_count", labels): count}

    queue = "pdserve_phase_queue_seconds"
    before = {**hist(queue, "prefill", "0", 1.0, 10), **hist(queue, "prefill", "1", 0.0, 0)}
    after = {
        **hist(queue, "prefill", "0", 1.3, 12),  # 2 requests, 0.3 s
        **hist(queue, "prefill", "1", 0.1, 2),  # 2 requests, 0.1 s
        **hist("pdserve_phase_prefill_seconds", "decode", "0", 0.0, 0),  # none: left out
    }
    # Both prefill workers together: 0.4 s over 4 requests.
    assert phase_means_ms(before, after) == {"prefill.queue": 100.0}


def test_prefill_paths_count_the_requests_between_two_scrapes() -> None:
    from bench.harness.metrics import prefill_paths

    def path(p: str, reason: str) -> tuple[str, frozenset[tuple[str, str]]]:
        return ("pdserve_prefill_path_total", frozenset({"path": p, "reason": reason}.items()))

    before = {path("remote", "prefill_within_slo"): 100.0, path("local", "short_prompt"): 3.0}
    after = {
        path("remote", "prefill_within_slo"): 130.0,
        path("local", "short_prompt"): 3.0,  # none this run: left out
        path("local", "prefill_saturated"): 5.0,  # a series that appeared during the run
    }
    counts = prefill_paths(before, after)
    assert counts == {"local/prefill_saturated": 5, "remote/prefill_within_slo": 30}


def test_the_phase_table_shows_each_pools_phases_per_run() -> None:
    from bench.suite_report import _phases

    phases = {
        "prefill.queue": 34.09,
        "prefill.compute": 40.19,
        "decode.kv_transfer": 4.93,
        "decode.kv_signal": 1.5,
    }
    paths = {"remote/prefill_within_slo": 30, "local/short_prompt": 6, "local/prefill_saturated": 4}
    shapes = {"1b": {"service": {"runs": [run("c", 21.0, phases_ms=phases, prefill_paths=paths)]}}}
    row = _phases(shapes, 512)[-1].split()
    assert row[:3] == ["1b", "c", "1"]
    # prefill queue, compute, KV, of it the last header's way
    assert row[5:9] == ["34.09", "40.19", "4.93", "1.50"]
    assert row[9:15] == ["-"] * 6  # no local prefill, decode admission or step; no colocated
    assert row[15] == "25%"  # 10 of 40 prompts prefilled on the decode worker


def test_the_hand_off_under_load_is_read_against_the_same_hand_off_alone() -> None:
    from bench.suite_report import _handoff_under_load

    def c_run(conc: int, rounds: int, ms: float | None) -> dict:
        return {"system": "c", "concurrency": conc, "rounds": rounds, "prompt_len": 512,
                "kv_transfer_ms_p50": ms}  # fmt: skip

    runs = [c_run(1, 12, 1.25), c_run(128, 1, 3.0), c_run(128, 4, 5.0), c_run(32, 4, None)]
    rows = _handoff_under_load({"1b": {"service": {"runs": runs}}}, 512)[3:]
    assert [row.split() for row in rows] == [
        ["1b", "128", "1", "512", "3.00", "1.25", "2.40"],  # the burst
        ["1b", "128", "4", "512", "5.00", "1.25", "4.00"],
    ]
