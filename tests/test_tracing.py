"""Traces in one process, in milliseconds: the router's spans of a request over fake
workers (one tree, the client's parent, the context each attempt hands its workers,
retries and resumes as attempts of their own, sampling), and the spans and phase
reports a worker makes of a request's phases."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk.trace", reason="the OpenTelemetry SDK is not installed")

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)

from bench.fake_workers import FakePools
from engine import tracing
from engine.core.outputs import FinalResult, TextChunk
from engine.core.request import FinishReason
from engine.sampling_params import SamplingParams
from engine.transfer.import_target import KVArrival
from engine.wire import GenerationInput, HandoffEntry, HandoffHeader, HeaderKind, TokenUpdate
from engine.worker.phases import Waiting, arrival_phases, decode_start_phases, prompt_phases
from router.observability.metrics import get_metrics
from router.observability.phase_metrics import get_phase_metrics
from router.observability.tracing import GENERATE_SPAN, trace_parent
from router.serving.config import RouterConfig
from router.serving.orchestrator import DisaggregatedGenerator
from router.serving.protocol import GenerateCall
from tests.fakes import WordTokenizer

CLIENT_TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN_ID = "b7ad6b7169203331"
PROMPT = tuple(range(100, 164))  # 64 tokens: prefilled remotely


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """Tracing on in this process (every request sampled), into memory."""
    exporter = InMemorySpanExporter()
    tracing.install(SimpleSpanProcessor(exporter), "pdserve-test")
    yield exporter
    tracing.shutdown()


def _call(sampled_parent: bool = True, **kwargs: Any) -> GenerateCall:
    params = SamplingParams(max_tokens=6, seed=3, ignore_eos=True)
    parent = {"traceparent": f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"} if sampled_parent else {}
    return GenerateCall("user-1", None, PROMPT, None, params, trace_parent=parent, **kwargs)


def _serve(pools: FakePools, call: GenerateCall) -> tuple[list[int], FinalResult]:
    async def body() -> tuple[list[int], FinalResult]:
        gen = DisaggregatedGenerator(
            pools,
            WordTokenizer(),
            RouterConfig(retry_delay_s=0.0),
        )
        gen.start()
        tokens: list[int] = []
        try:
            async for item in gen.generate(call):
                if isinstance(item, TextChunk):
                    tokens += item.token_ids
                else:
                    return tokens, item
        finally:
            await gen.stop()
        raise AssertionError("no final result")

    return asyncio.run(asyncio.wait_for(body(), 10))


def _by_name(exporter: InMemorySpanExporter) -> dict[str, list[ReadableSpan]]:
    out: dict[str, list[ReadableSpan]] = {}
    for span in exporter.get_finished_spans():
        out.setdefault(span.name, []).append(span)
    return out


def _parent_id(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def _carrier_span_id(carrier: dict[str, str]) -> int:
    return int(carrier["traceparent"].split("-")[2], 16)


def test_a_request_is_one_tree_under_the_callers_span(spans: InMemorySpanExporter) -> None:
    pools = FakePools(1, 1)
    tokens, final = _serve(pools, _call())
    assert final.finish_reason is FinishReason.LENGTH and len(tokens) == 6
    assert final.trace_id == CLIENT_TRACE_ID  # the caller's trace continues here
    named = _by_name(spans)
    for name in (GENERATE_SPAN, "router.admission", "router.attempt", "router.route"):
        assert len(named.get(name, [])) == 1, (name, sorted(named))
    root, attempt = named[GENERATE_SPAN][0], named["router.attempt"][0]
    assert {s.context.trace_id for s in spans.get_finished_spans()} == {int(CLIENT_TRACE_ID, 16)}
    assert _parent_id(root) == int(CLIENT_SPAN_ID, 16)
    assert _parent_id(named["router.admission"][0]) == root.context.span_id
    assert _parent_id(named["router.stream"][0]) == root.context.span_id
    assert _parent_id(attempt) == root.context.span_id
    for name in ("router.route", "router.prefill"):
        assert _parent_id(named[name][0]) == attempt.context.span_id, name
    route = named["router.route"][0].attributes or {}
    assert route["pdserve.route.decode_worker"] == "decode-0"
    assert route["pdserve.route.prefill_worker"] == "prefill-0"
    assert route["pdserve.route.path"] == "remote"
    assert (root.attributes or {})["pdserve.completion_tokens"] == 6
    # Both workers were handed the attempt's context: their spans join the tree there.
    for worker in ("prefill-0", "decode-0"):
        (carrier,) = pools.fakes[worker].trace_contexts.values()
        assert _carrier_span_id(carrier) == attempt.context.span_id, worker


def test_a_lost_attempt_is_marked_and_the_resume_is_an_attempt_of_its_own(
    spans: InMemorySpanExporter,
) -> None:
    pools = FakePools(1, 1)
    pools.fakes["decode-0"].refuse_kv = True  # after the first token: resumed on decode
    tokens, final = _serve(pools, _call())
    assert final.finish_reason is FinishReason.LENGTH and len(tokens) == 6
    attempts = sorted(_by_name(spans)["router.attempt"], key=lambda s: s.start_time or 0)
    assert len(attempts) == 2
    lost, resumed = attempts
    assert not lost.status.is_ok and "refused" in (lost.status.description or "")
    assert [e.name for e in lost.events] == ["attempt lost"]
    assert (lost.attributes or {})["pdserve.attempt.next"] == "resume"
    assert (resumed.attributes or {})["pdserve.attempt.kind"] == "resume"
    assert (resumed.attributes or {})["pdserve.attempt.resumed_tokens"] == 1
    assert resumed.status.is_ok
    # The resumed attempt's worker got that attempt's context, not the first one's.
    resumed_id = next(r for v, r in pools.fakes["decode-0"].calls if v == "submit")
    carrier = pools.fakes["decode-0"].trace_contexts[resumed_id]
    assert _carrier_span_id(carrier) == resumed.context.span_id


def test_sampling_follows_the_caller_and_the_ratio() -> None:
    exporter = InMemorySpanExporter()
    tracing.install(SimpleSpanProcessor(exporter), "pdserve-test", sample_ratio=0.0)
    try:
        pools = FakePools(1, 1)
        _, unsampled = _serve(pools, _call(sampled_parent=False))
        assert unsampled.trace_id == "" and exporter.get_finished_spans() == ()
        assert pools.fakes["prefill-0"].trace_contexts == {}  # workers record nothing either
        _, sampled = _serve(pools, _call())  # the caller sampled it: traced whatever the ratio
        assert sampled.trace_id == CLIENT_TRACE_ID and exporter.get_finished_spans()
    finally:
        tracing.shutdown()


def test_with_tracing_off_nothing_is_traced() -> None:
    assert not tracing.enabled()
    pools = FakePools(1, 1)
    _, final = _serve(pools, _call())
    assert final.trace_id == ""
    assert all(fake.trace_contexts == {} for fake in pools.fakes.values())


def test_trace_headers_come_from_the_calls_metadata() -> None:
    metadata = (("traceparent", "00-ab-cd-01"), ("tracestate", "x=1"), ("x-request-id", "r"))
    assert trace_parent(metadata) == {"traceparent": "00-ab-cd-01", "tracestate": "x=1"}
    assert trace_parent(None) == {}


def test_the_router_observes_each_workers_phases() -> None:
    registry = get_metrics().registry
    get_phase_metrics()  # on the router's registry
    decode_0 = {"pool": "decode", "worker": "0"}

    def count(phase: str, pool: str) -> float:
        labels = {"pool": pool, "worker": "0"}
        return registry.get_sample_value(f"pdserve_phase_{phase}_seconds_count", labels) or 0.0

    def received() -> float:
        return registry.get_sample_value("pdserve_kv_wire_bytes_total", decode_0) or 0.0

    series = [("queue", "prefill"), ("prefill", "prefill"), ("kv_transfer", "decode")]
    series += [("decode_admission", "decode"), ("first_decode_step", "decode")]
    before = {phases: count(*phases) for phases in series}
    bytes_before = received()
    _serve(FakePools(1, 1), _call(sampled_parent=False))
    for phases, was in before.items():
        assert count(*phases) == was + 1, phases  # each phase once per request
    assert received() == bytes_before + 4096


# ---------------------------------------------------------------- worker phases
def _traced_input() -> tuple[GenerationInput, int]:
    """A request whose context names a router span (its id returned)."""
    parent = tracing.start("router.attempt", tracing.extract({}), time.time_ns())
    inp = GenerationInput("r1", (1, 2, 3), SamplingParams(), trace_context=tracing.inject(parent))
    parent.end()
    return inp, parent.get_span_context().span_id


def test_a_prompt_reports_its_queue_and_compute_and_traces_them(
    spans: InMemorySpanExporter,
) -> None:
    inp, parent_id = _traced_input()
    since = time.monotonic() - 3.0
    first = TokenUpdate("r1", (7,), None, 2, True, scheduled_at=since + 1.0)
    report = prompt_phases("prefill", "prefill-0", inp, since, first, since + 2.5)
    assert report.queue_s == pytest.approx(1.0) and report.compute_s == pytest.approx(1.5)
    assert report.transfer_s is None and report.first_step_s is None
    named = _by_name(spans)
    queue, compute = named["prefill.queue"][0], named["prefill.compute"][0]
    assert _parent_id(queue) == _parent_id(compute) == parent_id
    assert (compute.attributes or {})["pdserve.cached_tokens"] == 2
    assert ((compute.end_time or 0) - (compute.start_time or 0)) / 1e9 == pytest.approx(1.5, 1e-3)
    # Untraced: the same report, no spans.
    plain = GenerationInput("r2", (1, 2, 3), SamplingParams())
    before = len(spans.get_finished_spans())
    assert prompt_phases("decode", "decode-0", plain, since, first, since + 2.5) == report
    assert len(spans.get_finished_spans()) == before


def test_a_kv_arrival_reports_its_share_of_the_busy_channel(spans: InMemorySpanExporter) -> None:
    inp, parent_id = _traced_input()
    entries = (HandoffEntry("r1", 3, 1, 7), HandoffEntry("other", 48, 3, 9))
    header = HandoffHeader(
        HeaderKind.HANDOFF,
        seq_no=4,
        dst_epoch=0xD,
        src_epoch=0xA,
        entries=entries,
        num_bytes=4000,
        posted_at_us=int(time.time() * 1e6) - 50_000,
    )
    arrival = KVArrival(inp, "prefill-0", header, 1000, 0.02, 0.05, time.monotonic())
    report = arrival_phases("decode-0", arrival)
    # A quarter of the message's bytes: a quarter of its receive time is this request's.
    assert report.wire_bytes == 1000 and report.wire_s == pytest.approx(0.005)
    assert report.transfer_s == 0.05
    named = _by_name(spans)
    transfer, receive = named["kv.transfer"][0], named["kv.receive"][0]
    assert _parent_id(transfer) == parent_id
    assert _parent_id(receive) == transfer.context.span_id
    attributes = transfer.attributes or {}
    assert attributes["pdserve.kv.pair"] == "prefill-0->decode-0"
    assert (attributes["pdserve.kv.src_epoch"], attributes["pdserve.kv.dst_epoch"]) == (
        "000000000000000a",
        "000000000000000d",
    )
    assert attributes["pdserve.kv.message_entries"] == 2
    assert ((transfer.end_time or 0) - (transfer.start_time or 0)) / 1e9 >= 0.045


def test_an_imported_request_reports_admission_and_first_step(
    spans: InMemorySpanExporter,
) -> None:
    inp, parent_id = _traced_input()
    landed = time.monotonic() - 1.0
    first = TokenUpdate("r1", (8,), None, 0, scheduled_at=landed + 0.25)
    report = decode_start_phases("decode-0", Waiting(inp, landed, True), first, landed + 0.75)
    assert report.admission_s == pytest.approx(0.25) and report.first_step_s == pytest.approx(0.5)
    named = _by_name(spans)
    assert _parent_id(named["decode.admission"][0]) == parent_id
    assert _parent_id(named["decode.first_step"][0]) == parent_id


def test_a_request_span_names_the_router_process_that_served_it(
    spans: InMemorySpanExporter,
) -> None:
    from router.observability.tracing import set_router_process

    set_router_process(2)  # as router process 2 of a router tier
    try:
        _serve(FakePools(1, 1), _call())
    finally:
        set_router_process(0)
    (root,) = _by_name(spans)[GENERATE_SPAN]
    assert (root.attributes or {})["pdserve.router_process"] == 2
