"""bench.suite_report's table of one request at a time: the 1P1D row carries the
router's own TTFT and the prefill worker's time beside the client's, so a GPU run shows
where the service's time before the first token went."""

from __future__ import annotations

from bench.suite_report import _ttft_c1


def run(system: str, ttft: float, **extra: dict[str, float]) -> dict:
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
    assert header.rstrip().endswith("c rtr   c wkr")
    cells = row.split()
    assert cells[:5] == ["1b", "512", "14.00", "20.00", "21.00"]
    assert cells[-2:] == ["19.50", "17.25"]


def test_a_run_from_before_the_split_shows_dashes() -> None:
    shapes = {"1b": {"service": {"runs": [run("c", 21.0)]}}}
    row = _ttft_c1(shapes, 512)[-1]
    assert row.split()[-2:] == ["-", "-"]
