"""Speculative decoding on a tensor-parallel worker (CPU, gloo): the embedded model split
over 3 processes, proposals from the draft model on rank 0 (the model drafting for
itself) or from n-grams, streams exactly the text of the colocated engine in one process,
greedy and seeded, and its proposals are accepted."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import pytest

from bench.harness import ServiceProcess
from bench.harness.streams import generate
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from pdserve.v1 import generation_pb2 as pb
from tests.services import StartService, assert_pools_empty

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPTS = [
    "Repeat exactly: the cat sat on the mat, the cat sat on the mat.",
    "1, 2, 3, 4, 5, 6,",
    "Tell me about the number 7.",
]
SEEDS = [None, 5, None]


def _service(start: StartService, ray_session: str, spec: dict[str, object]) -> ServiceProcess:
    return start(
        [
            "--ray-address",
            ray_session,
            "--colocated-workers",
            "1",
            "--tensor-parallel-size",
            "3",
            "--decode-kv-cache-gib",
            "0.05",
            "--speculative-config",
            json.dumps(spec),
        ],
        name=f"svc-tp3-{spec['method']}",
    )


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_a_split_worker_speculates_and_streams_one_processes_text(
    method: str,
    start_service: StartService,
    ray_session: str,
    smollm2_path: Path,
    reference_llm: LLM,
) -> None:
    spec: dict[str, object] = {"method": method, "num_speculative_tokens": 3}
    if method == "draft_model":
        spec["model"] = str(smollm2_path)
    else:
        spec |= {"prompt_lookup_max": 4, "prompt_lookup_min": 2}
    service = _service(start_service, ray_session, spec)
    params = [
        SamplingParams(
            max_tokens=16, temperature=0.0 if s is None else 0.8, seed=s, ignore_eos=True
        )
        for s in SEEDS
    ]

    async def scenario() -> list[list[int]]:
        results = await asyncio.gather(
            *(
                generate(
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
        assert all(r.code == grpc.StatusCode.OK and r.num_finals == 1 for r in results)
        stats = await assert_pools_empty(service.address, pools={pb.POOL_COLOCATED})
        [worker] = stats.workers
        assert worker.spec_decode_accepted_tokens > 0, worker
        return [r.tokens for r in results]

    outputs = asyncio.run(scenario())
    reference = reference_llm.generate(PROMPTS, params)
    assert outputs == [list(r.token_ids) for r in reference]
