"""End to end: a 1P1D service whose decode worker speculates (n-gram), over real gRPC and
Ray on loopback. Prompts handed off by the prefill pool and prompts run on the decode
worker itself give the colocated engine's tokens, greedy and seeded; a stop string ends
a run inside an accepted run; the counters reach GetPoolStats and /metrics; every
block comes back."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from bench.harness import ServiceProcess
from bench.harness.metrics import scrape
from bench.harness.metrics import value as metric_value
from bench.harness.streams import StreamResult, generate
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from pdserve.v1 import generation_pb2 as pb
from tests.services import StartService, assert_pools_empty

pytestmark = pytest.mark.e2e

LONG = (
    "def area(width, height):\n    return width * height\n\n"
    "def perimeter(width, height):\n    return 2 * (width + height)\n\n"
    "Rewrite both functions with type hints:\n"
)
PROMPTS = [
    LONG,  # past --local-prefill-max-tokens: handed off by the prefill pool
    "Repeat exactly: the cat sat on the mat, the cat sat on the mat.",
    LONG + "Also add docstrings.",
    "1, 2, 3, 4, 5, 6,",
]


@pytest.fixture(scope="module")
def service(start_service: StartService, ray_session: str) -> ServiceProcess:
    return start_service(
        [
            "--ray-address",
            ray_session,
            "--local-prefill-max-tokens",  # short prompts run on the decode worker
            "24",
            "--prefill-kv-cache-gib",
            "0.25",
            "--decode-kv-cache-gib",
            "0.25",
            "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
            '"prompt_lookup_min": 2}',
        ],
        name="spec",
    )


async def _collect(address: str, **kwargs: Any) -> StreamResult:
    result = await generate(address, **kwargs)
    assert result.code == grpc.StatusCode.OK, (result.code, result.details)
    assert result.num_finals == 1 and result.num_after_final == 0, result
    return result


def test_streams_equal_the_colocated_engine_and_counters_are_visible(
    service: ServiceProcess, reference_llm: LLM
) -> None:
    seeds = [None, 11, None, 12]  # greedy and seeded, mixed
    params = [
        SamplingParams(
            max_tokens=20,
            temperature=0.0 if seed is None else 0.7,
            seed=seed,
            ignore_eos=True,
        )
        for seed in seeds
    ]

    async def run() -> list[StreamResult]:
        return await asyncio.gather(
            *(
                _collect(
                    service.address,
                    prompt=prompt,
                    max_tokens=p.max_tokens,
                    temperature=p.temperature,
                    seed=p.seed,
                    ignore_eos=True,
                )
                for prompt, p in zip(PROMPTS, params, strict=True)
            )
        )

    served = asyncio.run(run())
    reference = reference_llm.generate(PROMPTS, params)
    for i, result in enumerate(served):
        assert result.tokens == list(reference[i].token_ids), f"prompt {i}"
    paths = {bool(r.final and r.final.timings.local_prefill) for r in served}
    assert paths == {True, False}  # both the hand-off and the decode worker's own prompts

    stats = asyncio.run(assert_pools_empty(service.address, pools={pb.POOL_DECODE}))
    decode = next(w for w in stats.workers if w.pool == pb.POOL_DECODE)
    assert decode.spec_decode_accepted_tokens > 0
    assert decode.spec_decode_draft_tokens >= decode.spec_decode_accepted_tokens
    assert decode.spec_decode_mean_accepted_length > 1.0
    prefill = next(w for w in stats.workers if w.pool == pb.POOL_PREFILL)
    assert prefill.spec_decode_draft_tokens == 0  # the prefill pool never speculates
    _, samples, _ = scrape(service.metrics_port)
    drafts = metric_value(samples, "pdserve_spec_decode_draft_tokens_total", pool="decode")
    accepted = metric_value(samples, "pdserve_spec_decode_accepted_tokens_total", pool="decode")
    assert drafts == decode.spec_decode_draft_tokens
    assert accepted == decode.spec_decode_accepted_tokens


def test_stop_string_inside_an_accepted_run_ends_the_stream_there(
    service: ServiceProcess, reference_llm: LLM
) -> None:
    prompt = "Repeat exactly: the quick brown fox jumps over the lazy dog.\nRepeated: the"
    params = SamplingParams(max_tokens=24, temperature=0.0, stop=("lazy",))
    want = reference_llm.generate([prompt], params)[0]
    got = asyncio.run(
        _collect(service.address, prompt=prompt, max_tokens=24, temperature=0.0, stop=["lazy"])
    )
    assert got.text == want.text and "lazy" not in got.text
    assert got.final is not None and got.final.finish_reason == pb.FINISH_REASON_STOP
    asyncio.run(assert_pools_empty(service.address, pools={pb.POOL_DECODE}))
