"""bench.ttft_trace lays each request's spans on one time line from its root span."""

from __future__ import annotations

from bench.harness.otlp import ReceivedSpan
from bench.ttft_trace import ROOT, timeline, whole_traces


def span(trace: str, name: str, start_ms: float, end_ms: float, service: str = "r") -> ReceivedSpan:
    base = 1_000_000_000 * (1 if trace == "a" else 5)  # the traces start seconds apart
    return ReceivedSpan(
        service, name, trace, name, "", base + int(start_ms * 1e6), base + int(end_ms * 1e6), 1, 0
    )


def test_spans_are_placed_from_their_own_root_and_the_median_is_taken() -> None:
    spans = [
        span("b", ROOT, 0, 40),
        span("b", "prefill.compute", 4, 30, "p"),
        span("a", ROOT, 0, 30),
        span("a", "prefill.compute", 2, 20, "p"),
        span("c", "prefill.compute", 1, 2, "p"),  # its root never arrived: left out
    ]
    traces = whole_traces(spans)
    assert [t[0].trace_id for t in traces] == ["a", "b"]
    rows = {r["span"]: r for r in timeline(traces)}
    compute = rows["p: prefill.compute"]
    assert (compute["start_ms"], compute["end_ms"], compute["length_ms"]) == (3.0, 25.0, 22.0)
    assert compute["count"] == 2
    assert rows[f"r: {ROOT}"]["end_ms"] == 35.0
