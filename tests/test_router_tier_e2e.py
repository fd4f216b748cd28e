"""End to end: a router tier (`pdserve serve --router-processes 2`) in front of one
prefill and one decode worker on the embedded model: both processes take calls on the
one port, every stream gives the colocated engine's text, and nothing is left held."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest

from bench.harness import ServiceProcess, StartService
from bench.harness.metrics import scrape
from bench.harness.metrics import value as metric_value
from bench.harness.pools import assert_pools_empty
from bench.harness.ports import free_port
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import generation_pb2_grpc as pb_grpc
from router.cli.client import build_request

pytestmark = pytest.mark.e2e

NUM_STREAMS = 32
NUM_CONNECTIONS = 8
PROMPTS = [f"Question {i}: what comes after {i}?" for i in range(NUM_STREAMS)]
MAX_TOKENS = [6 + i % 7 for i in range(NUM_STREAMS)]


def metrics_port_pair() -> int:
    """A port p with p + 1 free too: process i of the tier serves /metrics on p + i."""
    for _ in range(50):
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two consecutive free ports")


@pytest.fixture(scope="module")
def tier(start_service: StartService, ray_session: str) -> ServiceProcess:
    return start_service(
        [
            "--ray-address",
            ray_session,
            "--router-processes",
            "2",
            "--metrics-port",
            str(metrics_port_pair()),
            "--prefill-kv-cache-gib",
            "0.25",
            "--decode-kv-cache-gib",
            "0.25",
            "--enable-admin",
        ],
        name="tier",
    )


def channels(address: str, n: int) -> list[grpc.aio.Channel]:
    """`n` channels with a TCP connection each (channels to one target share one unless
    told not to): the kernel hands each connection to one of the tier's processes."""
    return [
        grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(n)
    ]


async def _stream(stub: pb_grpc.GenerationServiceStub, prompt: str, n: int) -> list[int]:
    tokens: list[int] = []
    finals = 0
    request = build_request(prompt=prompt, max_tokens=n, temperature=0.0, ignore_eos=True)
    async for response in stub.Generate(request):
        tokens.extend(response.token_ids)
        if response.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            finals += 1
            assert response.finish_reason == pb.FINISH_REASON_LENGTH
    assert finals == 1
    return tokens


def test_both_router_processes_serve_streams_with_the_colocated_engines_tokens(
    tier: ServiceProcess, reference_llm: LLM
) -> None:
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS]

    async def run() -> list[list[int]]:
        chans = channels(tier.address, NUM_CONNECTIONS)
        try:
            stubs = [pb_grpc.GenerationServiceStub(c) for c in chans]
            return await asyncio.gather(
                *(
                    _stream(stubs[i % NUM_CONNECTIONS], PROMPTS[i], MAX_TOKENS[i])
                    for i in range(NUM_STREAMS)
                )
            )
        finally:
            for c in chans:
                await c.close()

    served = asyncio.run(run())
    reference = reference_llm.generate(PROMPTS, params)
    for i, tokens in enumerate(served):
        assert tokens == list(reference[i].token_ids), f"stream {i} differs from colocated"
    # Each process counted its own calls on its own /metrics; together, every one.
    per_process = [
        metric_value(
            scrape(tier.metrics_port + i)[1], "pdserve_requests_total", finish_reason="length"
        )
        for i in range(2)
    ]
    assert all(n > 0 for n in per_process), per_process
    assert sum(per_process) == NUM_STREAMS
    # Nothing held on either worker, and the tier's shared admission is back to zero.
    asyncio.run(assert_pools_empty(tier.address, pools={pb.POOL_PREFILL, pb.POOL_DECODE}))
