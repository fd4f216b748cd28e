"""End to end: `pdserve serve` (router + 1 prefill + 1 decode Ray actor, gloo hand-off) over
real gRPC on loopback, against the colocated engine and transformers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from engine.factory import EngineArgs
from engine.llm import LLM, CompletionOutput
from engine.sampling_params import SamplingParams
from pdserve.v1 import generation_pb2 as pb
from router.client import get_pool_stats, stream_generate
from tests.service import ServiceProcess
from tests.test_metrics import scrape
from tests.test_metrics import value as metric_value

pytestmark = pytest.mark.e2e

CHUNK = 48  # prefill chunk threshold of the service under test

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
def service(
    tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path, ray_session: str
) -> Iterator[ServiceProcess]:
    log = tmp_path_factory.mktemp("svc") / "service.log"
    svc = ServiceProcess(
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
        ],
        log,
    )
    svc.wait_serving()
    yield svc
    code = svc.stop()
    assert code == 0, f"service did not exit cleanly on SIGTERM ({code}):\n{svc.log_tail()}"


@pytest.fixture(scope="module")
def colocated(smollm2_path: Path) -> LLM:
    return LLM(EngineArgs(kv_cache_gib=0.25))


Collected = tuple[list[int], str, pb.GenerateResponse]  # tokens, text, final message


async def _collect(address: str, **kwargs: object) -> Collected:
    tokens: list[int] = []
    text = ""
    final = None
    async for resp in stream_generate(address, **kwargs):  # type: ignore[arg-type]
        tokens.extend(resp.token_ids)
        text += resp.text
        if resp.finish_reason:
            final = resp
    assert final is not None, "stream ended without a final message"
    return tokens, text, final


async def _wait_pools_empty(address: str, timeout: float = 15.0) -> pb.GetPoolStatsResponse:
    deadline = time.monotonic() + timeout
    while True:
        stats = await get_pool_stats(address)
        if all(w.num_blocks_in_use == 0 for w in stats.workers) and stats.num_in_flight == 0:
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"blocks still in use: {stats}")
        await asyncio.sleep(0.2)


def test_health_went_from_not_serving_to_serving(service: ServiceProcess) -> None:
    assert service.health_seen[-1] == "SERVING"
    assert "NOT_SERVING" in service.health_seen


def test_greedy_streams_match_colocated_engine_and_transformers(
    service: ServiceProcess, colocated: LLM, smollm2_path: Path
) -> None:
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS]

    async def run() -> tuple[list[Collected], list[CompletionOutput]]:
        # The colocated engine runs in a thread of this process while the service (other
        # processes) serves: neither waits for the other.
        reference = asyncio.ensure_future(asyncio.to_thread(colocated.generate, PROMPTS, params))
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
    for i, (tokens, text, final) in enumerate(served):
        assert tokens == list(reference[i].token_ids), f"prompt {i} differs from colocated"
        assert text == reference[i].text
        assert final.finish_reason == pb.FINISH_REASON_LENGTH
        assert final.usage.completion_tokens == MAX_TOKENS[i]
    # Shared-prefix prompts were served partly from the prefill pool's prefix cache.
    shared = [i for i, p in enumerate(PROMPTS) if p.startswith(SHARED)]
    assert all(served[i][2].usage.cached_prompt_tokens >= 16 for i in shared)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype="float32")
    for i in (0, 3, 7, 11):  # plain, shared prefix, chunked, chunked
        ids = tok(PROMPTS[i], return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=MAX_TOKENS[i], do_sample=False)
        hf_tokens = out[0, ids.shape[1] :].tolist()
        # generate() stops at EOS; the service ran on (ignore_eos): compare what both made.
        assert served[i][0][: len(hf_tokens)] == hf_tokens, f"prompt {i} differs from HF"


def test_seeded_sampling_reproducible_and_equal_to_colocated(
    service: ServiceProcess, colocated: LLM
) -> None:
    kw = dict(max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    first = asyncio.run(_collect(service.address, prompt="Tell me a story", **kw))
    second = asyncio.run(_collect(service.address, prompt="Tell me a story", **kw))
    assert first[0] == second[0]
    ref = colocated.generate(
        ["Tell me a story"],
        SamplingParams(
            max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True
        ),
    )[0]
    assert first[0] == list(ref.token_ids)
    other = asyncio.run(_collect(service.address, prompt="Tell me a story", **{**kw, "seed": 99}))
    assert other[0] != first[0]


def test_stop_string_and_chat_messages(service: ServiceProcess, colocated: LLM) -> None:
    ref = colocated.generate(["1, 2, 3, 4,"], SamplingParams(max_tokens=20, temperature=0.0))[0]
    stop = ref.text[6:9]  # somewhere in the middle of what greedy produces
    tokens, text, final = asyncio.run(
        _collect(service.address, prompt="1, 2, 3, 4,", max_tokens=20, temperature=0.0, stop=[stop])
    )
    assert final.finish_reason == pb.FINISH_REASON_STOP
    assert text == ref.text[: ref.text.index(stop)]
    _, chat_text, chat_final = asyncio.run(
        _collect(service.address, messages=[("user", "Say hello.")], max_tokens=12, temperature=0.0)
    )
    assert chat_text and chat_final.usage.prompt_tokens > 5


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
    service: ServiceProcess, kwargs: dict[str, object], field: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        asyncio.run(_collect(service.address, **kwargs))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()
    tokens, _, _ = asyncio.run(_collect(service.address, prompt="hi", max_tokens=2))
    assert len(tokens) == 2


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

    async def cancel_after(delay: float, **kwargs: object) -> grpc.StatusCode:
        async def consume() -> None:
            async for _ in stream_generate(address, **kwargs):  # type: ignore[arg-type]
                pass

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(delay)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return grpc.StatusCode.CANCELLED
        return grpc.StatusCode.OK

    async def deadline() -> grpc.StatusCode:
        try:
            await _collect(
                address, prompt="Write a long essay.", max_tokens=400, ignore_eos=True, timeout=1.0
            )
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK

    async def scenario() -> None:
        bystanders = [
            asyncio.ensure_future(
                _collect(address, prompt=p, max_tokens=24, temperature=0.0, ignore_eos=True)
            )
            for p in PROMPTS[:4]
        ]
        long_prompt = "The history of the world, told in detail. " * 40  # many chunks
        results = await asyncio.gather(
            cancel_mid_stream(),
            cancel_after(0.3, prompt=long_prompt, max_tokens=50),  # while prefilling
            cancel_after(0.05, prompt="queued or reserving", max_tokens=50),
            deadline(),
        )
        assert results[0] >= 3
        assert results[1] == grpc.StatusCode.CANCELLED
        assert results[3] == grpc.StatusCode.DEADLINE_EXCEEDED
        for fut in bystanders:  # other streams unaffected
            tokens, _, final = await fut
            assert len(tokens) == 24 and final.finish_reason == pb.FINISH_REASON_LENGTH
        stats = await _wait_pools_empty(address)
        assert {w.pool for w in stats.workers} == {pb.POOL_PREFILL, pb.POOL_DECODE}

    asyncio.run(scenario())


def test_queue_full_is_resource_exhausted(service: ServiceProcess) -> None:
    # 24 in flight + 64 queued fit; a burst of 120 must see RESOURCE_EXHAUSTED for some.
    async def burst() -> list[grpc.StatusCode]:
        async def one() -> grpc.StatusCode:
            try:
                await _collect(service.address, prompt="hi", max_tokens=6, ignore_eos=True)
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK

        return await asyncio.gather(*(one() for _ in range(120)))

    codes = asyncio.run(burst())
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes
    assert grpc.StatusCode.OK in codes
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}
    asyncio.run(_wait_pools_empty(service.address))


def test_metrics_endpoint_shows_requests_and_every_worker(service: ServiceProcess) -> None:
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
    for pool in ("prefill", "decode"):
        ratio = metric_value(after, "pdserve_kv_cache_usage_ratio", pool=pool, worker="0")
        assert 0 <= ratio <= 1
        assert (
            "pdserve_num_requests_running",
            frozenset({("pool", pool), ("worker", "0")}),
        ) in after
    assert types["pdserve_router_in_flight"] == "gauge"
