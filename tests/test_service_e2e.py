"""End to end: `pdserve serve` (router + 1 prefill + 1 decode Ray actor, gloo hand-off) over
real gRPC on loopback, against the colocated engine and transformers; as an operator
watches it: every request traced to an OTLP receiver in this process, and a real
Prometheus (Debian package `prometheus`) scraping it and evaluating the dashboard's
queries and the alerting rules."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from bench.harness import REPO, ServiceProcess, wait_until
from bench.harness.metrics import scrape
from bench.harness.metrics import value as metric_value
from bench.harness.streams import StreamResult, generate
from engine.frontend.prompt import encode_prompt
from engine.llm import LLM, CompletionOutput
from engine.sampling_params import SamplingParams
from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import generation_pb2_grpc as pb_grpc
from router.cli.client import build_request, stream_generate
from router.observability.tracing import GENERATE_SPAN
from tests.otlp_sink import OTLPSink, ReceivedSpan
from tests.prometheus_server import PrometheusServer, find_binary
from tests.services import StartService, assert_pools_empty

pytestmark = pytest.mark.e2e

CHUNK = 48  # prefill chunk threshold of the service under test
LEASE_S = 0.5  # decode reservation lease of the service under test

SHARED = (
    "You are a careful assistant. Answer briefly and precisely, and never make up facts. "
    "The following question comes from a curious student who likes science. "
)
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    SHARED + "Why is the sky blue?",
    SHARED + "What do plants need to grow?",
    SHARED + "How far away is the Moon?",
    "Explain photosynthesis in one sentence.",
    "Tell me a joke about computers. " * 12,  # longer than the chunk threshold
    "Once upon a time",
    "1, 2, 3, 4,",
    "Translate 'good morning' into Spanish.",
    "The quick brown fox " * 20,
    "Describe a cat.",
    SHARED + "What is gravity?",
    "Name a color.",
    "Summarise the plot of Romeo and Juliet in two sentences.",
]
MAX_TOKENS = [12, 20, 8, 16, 10, 24, 14, 6, 18, 9, 11, 7, 22, 13, 5, 15]


@pytest.fixture(scope="module")
def trace_sink() -> Iterator[OTLPSink]:
    """The collector the service sends its traces to."""
    with OTLPSink() as receiver:
        yield receiver


@pytest.fixture(scope="module")
def service(trace_sink: OTLPSink, start_service: StartService, ray_session: str) -> ServiceProcess:
    # `trace_sink` first: it outlives the service, which sends its last spans as it stops.
    return start_service(
        [
            "--ray-address",
            ray_session,
            "--local-prefill-max-tokens",  # every prompt goes through the prefill pool
            "0",
            "--prefill-long-prefill-token-threshold",
            str(CHUNK),
            "--prefill-kv-cache-gib",
            "0.25",
            "--decode-kv-cache-gib",
            "0.25",
            "--max-in-flight",
            "24",
            "--max-queue",
            "64",
            "--drain-grace-s",
            "20",
            "--otlp-traces-endpoint",
            trace_sink.endpoint,
            # Short, so that a burst's prefill queue outlasts it (renewal keeps them).
            "--reservation-lease-s",
            str(LEASE_S),
            # The planner, boxed in at one worker a pool (so it never resizes them here),
            # for the series of its dashboard panels.
            "--planner",
            "--max-gpus",
            "2",
            "--planner-interval-s",
            "1",
        ],
        name="svc",
        # The SDK's standard knob, passed on to the workers: spans leave within 0.2 s.
        env={"OTEL_BSP_SCHEDULE_DELAY": "200"},
    )


async def _collect(address: str, **kwargs: Any) -> StreamResult:
    """One call that must end with exactly one final message and status OK."""
    result = await generate(address, **kwargs)
    assert result.code == grpc.StatusCode.OK, (result.code, result.details)
    assert result.num_finals == 1 and result.num_after_final == 0, result
    return result


BOTH_POOLS = {pb.POOL_PREFILL, pb.POOL_DECODE}


def test_health_went_from_not_serving_to_serving(service: ServiceProcess) -> None:
    assert service.health_seen[-1] == "SERVING"
    assert "NOT_SERVING" in service.health_seen


def test_greedy_streams_match_colocated_engine_and_transformers(
    service: ServiceProcess, reference_llm: LLM, smollm2_path: Path
) -> None:
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS]

    async def run() -> tuple[list[StreamResult], list[CompletionOutput]]:
        # The colocated engine runs in a thread of this process while the service (other
        # processes) serves: neither waits for the other.
        reference = asyncio.ensure_future(
            asyncio.to_thread(reference_llm.generate, PROMPTS, params)
        )
        # Put the shared prefix in the prefill pool's prefix cache first.
        await _collect(service.address, prompt=SHARED + "Hi.", max_tokens=2)
        served = await asyncio.gather(
            *(
                _collect(service.address, prompt=p, max_tokens=n, temperature=0.0, ignore_eos=True)
                for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)
            )
        )
        return served, await reference

    served, reference = asyncio.run(run())
    for i, result in enumerate(served):
        assert result.tokens == list(reference[i].token_ids), f"prompt {i} differs from colocated"
        assert result.text == reference[i].text
        assert result.final is not None
        assert result.final.finish_reason == pb.FINISH_REASON_LENGTH
        assert result.final.usage.completion_tokens == MAX_TOKENS[i]
    # Shared-prefix prompts were served partly from the prefill pool's prefix cache.
    shared = [i for i, p in enumerate(PROMPTS) if p.startswith(SHARED)]
    assert all(_final(served[i]).usage.cached_prompt_tokens >= 16 for i in shared)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype="float32")
    for i in (0, 3, 7, 11):  # plain, shared prefix, chunked, chunked
        ids = tok(PROMPTS[i], return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=MAX_TOKENS[i], do_sample=False)
        hf_tokens = out[0, ids.shape[1] :].tolist()
        assert hf_tokens, f"transformers generated nothing for prompt {i}"
        # generate() stops at EOS; the service ran on (ignore_eos): compare what both made.
        assert served[i].tokens[: len(hf_tokens)] == hf_tokens, f"prompt {i} differs from HF"


def _final(result: StreamResult) -> pb.GenerateResponse:
    assert result.final is not None
    return result.final


def test_seeded_sampling_reproducible_and_equal_to_colocated(
    service: ServiceProcess, reference_llm: LLM
) -> None:
    kw = dict(max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    first = asyncio.run(_collect(service.address, prompt="Tell me a story", **kw))
    second = asyncio.run(_collect(service.address, prompt="Tell me a story", **kw))
    assert len(first.tokens) == 16
    assert first.tokens == second.tokens
    ref = reference_llm.generate(
        ["Tell me a story"],
        SamplingParams(
            max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True
        ),
    )[0]
    assert first.tokens == list(ref.token_ids)
    other = asyncio.run(_collect(service.address, prompt="Tell me a story", **{**kw, "seed": 99}))
    assert other.tokens != first.tokens


def test_stop_string_and_chat_messages(service: ServiceProcess, reference_llm: LLM) -> None:
    greedy = SamplingParams(max_tokens=20, temperature=0.0)
    ref = reference_llm.generate(["1, 2, 3, 4,"], greedy)[0]
    stop = ref.text[6:9]  # somewhere in the middle of what greedy produces
    stopped = asyncio.run(
        _collect(service.address, prompt="1, 2, 3, 4,", max_tokens=20, temperature=0.0, stop=[stop])
    )
    assert _final(stopped).finish_reason == pb.FINISH_REASON_STOP
    assert stopped.text == ref.text[: ref.text.index(stop)]
    # A chat turn goes through the model's chat template, as the engine's own encoding does.
    messages = [("user", "Say hello.")]
    chat = asyncio.run(_collect(service.address, messages=messages, max_tokens=12, temperature=0.0))
    ids = encode_prompt(reference_llm.tokenizer, messages=messages)
    chat_ref = reference_llm.generate([ids], SamplingParams(max_tokens=12, temperature=0.0))[0]
    assert _final(chat).usage.prompt_tokens == len(ids)
    assert chat.tokens == list(chat_ref.token_ids) and chat.text == chat_ref.text


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "temperature": -1.0}, "temperature"),
        ({"prompt": "hi", "top_p": 0.0}, "top_p"),
        ({"prompt": "hi", "top_p": 1.5}, "top_p"),
        ({"prompt": "hi", "top_k": -1}, "top_k"),
        ({"prompt": ""}, "prompt"),
        ({"prompt_token_ids": [1, 2, 10**6]}, "vocabulary"),
        ({"prompt": "hi", "max_tokens": 100_000}, "context length"),
        ({}, "input"),
    ],
)
def test_invalid_requests_are_refused_and_server_keeps_serving(
    service: ServiceProcess, kwargs: dict[str, Any], field: str
) -> None:
    refused = asyncio.run(generate(service.address, **kwargs))
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT
    assert field in refused.details
    assert refused.tokens == [] and refused.final is None
    ok = asyncio.run(_collect(service.address, prompt="hi", max_tokens=2))
    assert len(ok.tokens) == 2


def test_cancellations_and_deadlines_free_every_block(service: ServiceProcess) -> None:
    address = service.address

    async def cancel_mid_stream() -> int:
        n = 0
        async for resp in stream_generate(
            address, prompt="Count to one hundred:", max_tokens=300, ignore_eos=True
        ):
            n += len(resp.token_ids)
            if n >= 3:
                break  # leaving the iterator cancels the RPC
        return n

    async def cancel_once(started: asyncio.Event, **kwargs: Any) -> bool:
        """Cancel the call once `started` is set; True if it was still running then."""
        call = asyncio.ensure_future(generate(address, **kwargs))
        await started.wait()
        cancelled = not call.done()
        call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await call
        return cancelled

    async def cancel_once_sent(**kwargs: Any) -> grpc.StatusCode:
        """Cancel a call as soon as the router has it (queued, reserving or prefilling)."""
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            call = stub.Generate(build_request(**kwargs))
            await call.wait_for_connection()
            call.cancel()
            return await call.code()

    async def scenario() -> None:
        bystanders = [
            asyncio.ensure_future(
                _collect(address, prompt=p, max_tokens=24, temperature=0.0, ignore_eos=True)
            )
            for p in PROMPTS[:4]
        ]
        # Cancelled while prefilling: a prompt of many chunks, cancelled once a short
        # prompt sent beside it has its first token (the long one's prefill is under way).
        long_prompt = "The history of the world, told in detail. " * 40
        short_done = asyncio.Event()
        short = asyncio.ensure_future(
            generate(address, prompt="Hi", max_tokens=1, on_tokens=lambda n: short_done.set())
        )
        mid, prefilling, early, deadline = await asyncio.gather(
            cancel_mid_stream(),
            cancel_once(short_done, prompt=long_prompt, max_tokens=50),
            cancel_once_sent(prompt="queued or reserving", max_tokens=50),
            generate(
                address, prompt="Write a long essay.", max_tokens=400, ignore_eos=True, timeout=1.0
            ),
        )
        assert (await short).num_finals == 1
        assert mid >= 3
        assert prefilling, "the long prompt finished before it could be cancelled"
        assert early == grpc.StatusCode.CANCELLED
        assert deadline.code == grpc.StatusCode.DEADLINE_EXCEEDED
        for fut in bystanders:  # other streams unaffected
            result = await fut
            assert len(result.tokens) == 24
            assert _final(result).finish_reason == pb.FINISH_REASON_LENGTH
        await assert_pools_empty(address, timeout=15, pools=BOTH_POOLS)

    asyncio.run(scenario())


def test_queue_full_is_resource_exhausted(service: ServiceProcess) -> None:
    # 24 in flight + 64 queued fit; a burst of 120 must see RESOURCE_EXHAUSTED for some.
    async def burst() -> list[StreamResult]:
        return await asyncio.gather(
            *(
                generate(service.address, prompt="hi", max_tokens=6, ignore_eos=True)
                for _ in range(120)
            )
        )

    results = asyncio.run(burst())
    codes = [r.code for r in results]
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes
    assert set(codes) == {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}
    # At most what fits was admitted; every admitted request ran to its full length.
    admitted = [r for r in results if r.code == grpc.StatusCode.OK]
    assert len(admitted) >= 24
    assert all(len(r.tokens) == 6 and r.num_finals == 1 for r in admitted)
    asyncio.run(assert_pools_empty(service.address, pools=BOTH_POOLS))


def test_metrics_endpoint_shows_requests_and_every_worker(service: ServiceProcess) -> None:
    # Other tests' requests may still be leaving the pools: start from a quiet service.
    asyncio.run(assert_pools_empty(service.address))
    before = scrape(service.metrics_port)[1]

    async def run() -> None:
        for prompt in ("One", "Two", SHARED + "Three"):
            await _collect(service.address, prompt=prompt, max_tokens=5, ignore_eos=True)

    asyncio.run(run())
    types, after, _ = scrape(service.metrics_port)

    def delta(name: str, **labels: str) -> float:
        return metric_value(after, name, **labels) - metric_value(before, name, **labels)

    assert delta("pdserve_requests_total", finish_reason="length") == 3
    assert delta("pdserve_generation_tokens_total") == 15
    assert delta("pdserve_time_to_first_token_seconds_count") == 3
    assert delta("pdserve_request_prefill_time_seconds_count") == 3
    assert delta("pdserve_kv_transfer_seconds_count") == 3  # one hand-off per request
    assert delta("pdserve_prefix_cache_queries_total", pool="prefill") > 0
    # Where the time went, per worker: each request's phases, once each.
    prefill_0, decode_0 = {"pool": "prefill", "worker": "0"}, {"pool": "decode", "worker": "0"}
    assert delta("pdserve_phase_queue_seconds_count", **prefill_0) == 3
    assert delta("pdserve_phase_prefill_seconds_count", **prefill_0) == 3
    for phase in ("kv_transfer", "kv_signal", "decode_admission", "first_decode_step"):
        assert delta(f"pdserve_phase_{phase}_seconds_count", **decode_0) == 3, phase
    assert delta("pdserve_kv_wire_bytes_total", **decode_0) > 0
    assert 0 < delta("pdserve_kv_wire_seconds_total", **decode_0) < 10
    for pool in ("prefill", "decode"):
        ratio = metric_value(after, "pdserve_kv_cache_usage_ratio", pool=pool, worker="0")
        assert 0 <= ratio <= 1
        assert (
            "pdserve_num_requests_running",
            frozenset({("pool", pool), ("worker", "0")}),
        ) in after
    assert types["pdserve_router_in_flight"] == "gauge"


def test_a_burst_whose_prefill_queue_outlasts_the_lease_completes_in_full(
    service: ServiceProcess,
) -> None:
    # Prompts of ~240 tokens sent at once, prefilled 48 tokens a step each: the last ones
    # wait in the prefill worker past the decode reservations' lease.
    sentence = "The river runs past the old mill and on to the sea. "
    prompts = [f"Report {i}. " + sentence * 20 for i in range(6)]

    async def burst() -> list[StreamResult]:
        return await asyncio.gather(
            *(_collect(service.address, prompt=p, max_tokens=2, ignore_eos=True) for p in prompts)
        )

    results = asyncio.run(burst())
    for result in results:
        assert _final(result).finish_reason == pb.FINISH_REASON_LENGTH, result.final
        assert len(result.tokens) == 2
        # Its KV was handed off and taken: the reservation held (a refused hand-off would
        # have recomputed the prompt on the decode worker, with no hand-off time).
        assert _final(result).timings.kv_transfer_seconds > 0
    slowest = max(_final(r).timings.time_to_first_token_seconds for r in results)
    assert slowest > LEASE_S, f"the burst's queue ({slowest:.2f} s) did not outlast the lease"
    asyncio.run(assert_pools_empty(service.address, pools=BOTH_POOLS))


# ---------------------------------------------------------------- observability
CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"
TRACED_PROMPT = "Write a short poem about the sea, the wind and the stars over the harbour."
# One traced 1P1D request: the router's spans, the prefill worker's, the decode worker's.
ROUTER_SPANS = {GENERATE_SPAN, "router.admission", "router.attempt", "router.route"}
ROUTER_SPANS |= {"router.prefill", "router.stream"}
PREFILL_SPANS = {"prefill.queue", "prefill.compute", "kv.send"}
DECODE_SPANS = {"kv.transfer", "kv.receive", "decode.admission", "decode.first_step"}


def _generate(address: str, **kwargs: Any) -> StreamResult:
    return asyncio.run(
        generate(address, prompt=TRACED_PROMPT, max_tokens=4, temperature=0, **kwargs)
    )


def _spans_of(sink: OTLPSink, trace_id: str, names: set[str]) -> dict[str, ReceivedSpan]:
    """The trace's spans by name once every name has arrived (one span each)."""

    def complete() -> dict[str, ReceivedSpan]:
        spans = {s.name: s for s in sink.trace(trace_id)}
        return spans if names <= set(spans) else {}

    try:
        return wait_until(complete, 30, what=f"spans of trace {trace_id}")
    except TimeoutError:
        got = sorted(s.name for s in sink.trace(trace_id))
        raise AssertionError(f"trace {trace_id}: missing {names - set(got)}, got {got}") from None


def test_a_traced_request_is_one_trace_across_the_router_and_both_workers(
    service: ServiceProcess, trace_sink: OTLPSink
) -> None:
    traceparent = f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"
    result = _generate(
        service.address, metadata=[("traceparent", traceparent)], include_trace_id=True
    )
    assert result.outcome == "final:FINISH_REASON_LENGTH", result.details
    assert result.final is not None and result.final.timings.trace_id == CLIENT_TRACE_ID

    spans = _spans_of(trace_sink, CLIENT_TRACE_ID, ROUTER_SPANS | PREFILL_SPANS | DECODE_SPANS)
    trace = trace_sink.trace(CLIENT_TRACE_ID)
    assert len(trace) == len(spans), sorted(s.name for s in trace)  # one of each, no strays
    root = spans[GENERATE_SPAN]
    attempt = spans["router.attempt"]
    assert root.parent_span_id == CLIENT_SPAN_ID  # the client's span is the parent
    # Every other span hangs off a span of this trace: parent links intact.
    ids = {s.span_id for s in trace}
    assert all(s.parent_span_id in ids for s in trace if s is not root)
    for name in ROUTER_SPANS - {GENERATE_SPAN}:
        expected_parent = attempt if name in ("router.route", "router.prefill") else root
        assert spans[name].parent_span_id == expected_parent.span_id, name
    for name in PREFILL_SPANS | DECODE_SPANS - {"kv.receive"}:
        assert spans[name].parent_span_id == attempt.span_id, name  # across Ray calls
    assert spans["kv.receive"].parent_span_id == spans["kv.transfer"].span_id
    # Each process reports as itself.
    assert {spans[n].service for n in ROUTER_SPANS} == {"pdserve-router"}
    assert {spans[n].service for n in PREFILL_SPANS} == {"pdserve-prefill"}
    assert {spans[n].service for n in DECODE_SPANS} == {"pdserve-decode"}

    route = spans["router.route"].attributes
    assert route["pdserve.route.decode_worker"] == "decode-0"
    assert route["pdserve.route.prefill_worker"] == "prefill-0"
    assert (route["pdserve.route.path"], route["pdserve.route.reason"]) == (
        "remote",
        "local_prefill_off",
    )
    compute = spans["prefill.compute"].attributes
    assert compute["pdserve.worker"] == "prefill-0"
    assert compute["pdserve.prompt_tokens"] == root.attributes["pdserve.prompt_tokens"]
    assert compute["pdserve.cached_tokens"] == result.final.usage.cached_prompt_tokens
    sent, moved = spans["kv.send"].attributes, spans["kv.transfer"].attributes
    assert sent["pdserve.kv.pair"] == moved["pdserve.kv.pair"] == "prefill-0->decode-0"
    assert moved["pdserve.kv.bytes"] == sent["pdserve.kv.bytes"] > 0
    assert sent["pdserve.kv.outcome"] == "success"
    for key in ("pdserve.kv.src_epoch", "pdserve.kv.dst_epoch", "pdserve.kv.seq_no"):
        assert sent[key] == moved[key], key
    assert moved["pdserve.kv.src_epoch"] != moved["pdserve.kv.dst_epoch"]
    assert 0 < moved["pdserve.kv.wire_s"] <= moved["pdserve.kv.handoff_s"]
    assert spans["decode.first_step"].attributes["pdserve.worker"] == "decode-0"
    assert root.attributes["pdserve.finish_reason"] == "length"
    assert root.attributes["pdserve.completion_tokens"] == 4
    # The phases follow each other: queue, compute, then the KV lands and decoding starts.
    assert spans["prefill.queue"].end_ns <= spans["prefill.compute"].start_ns + 1000
    assert spans["kv.transfer"].end_ns <= spans["decode.admission"].start_ns + 1000
    assert spans["decode.admission"].end_ns <= spans["decode.first_step"].start_ns + 1000
    assert f"trace={CLIENT_TRACE_ID}" in service.log_path.read_text()  # the router's log line


def test_a_request_without_a_traceparent_starts_a_trace_of_its_own(
    service: ServiceProcess, trace_sink: OTLPSink
) -> None:
    asked = _generate(service.address, include_trace_id=True)
    assert asked.final is not None
    trace_id = asked.final.timings.trace_id
    assert len(trace_id) == 32 and trace_id != CLIENT_TRACE_ID
    root = _spans_of(trace_sink, trace_id, {GENERATE_SPAN})[GENERATE_SPAN]
    assert root.parent_span_id == ""
    not_asked = _generate(service.address)
    assert not_asked.final is not None and not_asked.final.timings.trace_id == ""


def _dashboard_queries() -> list[str]:
    dashboard = json.loads((REPO / "deploy" / "grafana" / "pdserve.json").read_text())
    return [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]


@pytest.mark.skipif(
    find_binary("prometheus") is None or find_binary("promtool") is None,
    reason="prometheus/promtool not installed (Debian package `prometheus`; .ci/run installs it)",
)
def test_prometheus_scrapes_the_service_and_every_dashboard_query_has_data(
    service: ServiceProcess, tmp_path: Path
) -> None:
    async def traffic() -> list[StreamResult]:
        calls = [generate(service.address, prompt=TRACED_PROMPT, max_tokens=4) for _ in range(3)]
        calls.append(generate(service.address, prompt=""))  # INVALID_ARGUMENT
        return await asyncio.gather(*calls)

    # A labelled series appears with its first use; one that first shows up after the
    # traffic has no increase for rate() to see. Traffic before the first scrape makes
    # every series the dashboard reads exist then, whatever ran before this test.
    asyncio.run(traffic())
    with PrometheusServer(tmp_path, f"127.0.0.1:{service.metrics_port}") as prom:
        wait_until(prom.targets_up, 30, what="pdserve scraped")
        results = asyncio.run(traffic())
        assert [r.code for r in results] == [grpc.StatusCode.OK] * 3 + [
            grpc.StatusCode.INVALID_ARGUMENT
        ]
        # Grafana's $__rate_interval: a window that holds the traffic and scrapes around it.
        queries = [q.replace("$__rate_interval", "5m") for q in _dashboard_queries()]
        for query in queries:
            for attempt in range(3):
                try:
                    wait_until(functools.partial(prom.numbers, query), 15, what=f"data for {query}")
                    break
                except TimeoutError as exc:
                    # Now and then a rate() over the traffic stays empty on a loaded
                    # machine although every scrape succeeded; more traffic gives it
                    # fresh increases (the query must still find data).
                    if attempt == 2:
                        raise TimeoutError(f"{exc}; last scrapes: {prom.scrapes()}") from None
                    asyncio.run(traffic())
        for rule in prom.rules():
            assert rule["health"] == "ok", rule
            if rule["name"] in ("PdserveNotServing", "PdservePoolBelowSize", "PdserveDown"):
                assert rule["state"] == "inactive", rule  # a healthy service
        assert prom.numbers("pdserve_serving") == [1.0]

    with urllib.request.urlopen(f"http://127.0.0.1:{service.metrics_port}/metrics") as resp:
        exposition = resp.read()
    lint = subprocess.run(
        [str(find_binary("promtool")), "check", "metrics"], input=exposition, capture_output=True
    )
    assert lint.returncode == 0, lint.stdout.decode() + lint.stderr.decode()
