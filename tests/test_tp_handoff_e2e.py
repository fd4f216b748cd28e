"""1P1D with pools of different tensor-parallel sizes (CPU, gloo): the embedded model's
9 attention heads and 3 KV heads split over 3 prefill processes hand their KV, head by
head, to a decode worker of one (and the other way round), and the service streams the
greedy text of one process, leaving both pools empty."""

from __future__ import annotations

import asyncio

import pytest

from bench.harness import ServiceProcess
from bench.harness.streams import generate
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from pdserve.v1 import generation_pb2 as pb
from tests.services import StartService, assert_pools_empty

pytestmark = pytest.mark.e2e

PROMPTS = [
    "Tell me about the number 7.",
    "What is the capital of France? Answer in one short sentence, please.",
    "Write one line about the sea.",
]


def _pools_service(start_service: StartService, ray_session: str, *sizes: str) -> ServiceProcess:
    return start_service(
        [
            "--ray-address",
            ray_session,
            *sizes,
            "--local-prefill-max-tokens",
            "0",  # every prompt is handed off
            "--prefill-kv-cache-gib",
            "0.05",
            "--decode-kv-cache-gib",
            "0.05",
        ],  # fmt: skip
        name="svc-tp-pools",
    )


def _check(service: ServiceProcess, reference_llm: LLM) -> None:
    async def scenario() -> list[list[int]]:
        results = await asyncio.gather(
            *(
                generate(service.address, prompt=p, max_tokens=10, temperature=0.0, ignore_eos=True)
                for p in PROMPTS
            )
        )
        assert all(r.outcome == "final:FINISH_REASON_LENGTH" for r in results), results
        await assert_pools_empty(service.address, pools={pb.POOL_PREFILL, pb.POOL_DECODE})
        return [r.tokens for r in results]

    outputs = asyncio.run(scenario())
    reference = reference_llm.generate(
        PROMPTS, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    )
    assert outputs == [list(r.token_ids) for r in reference]


def test_three_prefill_ranks_hand_their_heads_to_one_decode_process(
    start_service: StartService, ray_session: str, reference_llm: LLM
) -> None:
    service = _pools_service(start_service, ray_session, "--prefill-tensor-parallel-size", "3")
    _check(service, reference_llm)


@pytest.mark.slow
def test_one_prefill_process_hands_each_head_to_its_decode_rank(
    start_service: StartService, ray_session: str, reference_llm: LLM
) -> None:
    service = _pools_service(start_service, ray_session, "--decode-tensor-parallel-size", "3")
    _check(service, reference_llm)
