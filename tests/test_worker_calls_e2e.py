"""`--worker-calls ray`: the router calls its workers through Ray instead of their own
connections, and serves the same tokens (1P1D on the embedded model, every prompt handed
off, an abort in flight, every block back)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from bench.harness.streams import generate
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from pdserve.v1 import generation_pb2 as pb
from tests.services import StartService, assert_pools_empty

PROMPTS = ["The capital of France is", "Water boils at", "A haiku about the sea:"]
MAX_TOKENS = 12


@pytest.mark.slow  # a service of its own: `make test-slow`
def test_ray_calls_serve_the_colocated_engines_tokens(
    start_service: StartService, ray_session: str, reference_llm: LLM
) -> None:
    svc = start_service(
        ["--ray-address", ray_session, "--worker-calls", "ray", "--local-prefill-max-tokens", "0"]
        + ["--prefill-kv-cache-gib", "0.25", "--decode-kv-cache-gib", "0.25"],
        name="ray-calls",
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    reference = reference_llm.generate(PROMPTS, [params] * len(PROMPTS))

    async def run() -> None:
        served = await asyncio.gather(
            *(
                generate(
                    svc.address, prompt=p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True
                )
                for p in PROMPTS
            ),
            # Cancelled while it runs: its blocks come back on both workers.
            asyncio.wait_for(generate(svc.address, prompt=PROMPTS[0], max_tokens=400), 1.0),
            return_exceptions=True,
        )
        for i, result in enumerate(served[: len(PROMPTS)]):
            assert not isinstance(result, BaseException), result
            assert result.code == grpc.StatusCode.OK, (result.code, result.details)
            assert result.num_finals == 1 and result.num_after_final == 0
            assert result.tokens == list(reference[i].token_ids), f"prompt {i} differs"
        await assert_pools_empty(svc.address, pools={pb.POOL_PREFILL, pb.POOL_DECODE})

    asyncio.run(run())
