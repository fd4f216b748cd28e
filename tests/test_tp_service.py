"""A tensor-parallel worker behind the router (CPU, gloo): the embedded model split over 3
processes (its 9 attention heads and 3 KV heads) streams the greedy text of one process,
and losing any one rank replaces the worker as a whole."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from bench.harness import ServiceProcess
from bench.harness.streams import generate
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from pdserve.v1 import admin_pb2 as apb  # noqa: F401 - the admin API's types load
from pdserve.v1 import generation_pb2 as pb
from router.cli.client import get_pool_stats
from tests.services import StartService, assert_pools_empty

pytestmark = pytest.mark.e2e

PROMPTS = ["Tell me about the number 7.", "What is the capital of France?"]


@pytest.fixture(scope="module")
def service(start_service: StartService, ray_session: str) -> ServiceProcess:
    return start_service(
        [
            "--ray-address",
            ray_session,
            "--colocated-workers",
            "1",
            "--tensor-parallel-size",
            "3",
            "--decode-kv-cache-gib",
            "0.05",
        ],
        name="svc-tp3",
    )


def _pids(actor: str) -> list[int]:
    """Process ids of a kind of Ray actor, from `ps` (one service runs in this module)."""
    out = os.popen("ps -eo pid,args").read().splitlines()
    return [int(line.split()[0]) for line in out if f"ray::{actor}" in line]


def test_a_worker_split_over_three_processes_streams_one_processes_text(
    service: ServiceProcess, reference_llm: LLM
) -> None:
    async def scenario() -> list[list[int]]:
        results = await asyncio.gather(
            *(
                generate(service.address, prompt=p, max_tokens=12, temperature=0.0, ignore_eos=True)
                for p in PROMPTS
            )
        )
        stats = await assert_pools_empty(service.address, pools={pb.POOL_COLOCATED})
        assert [w.pool for w in stats.workers] == [pb.POOL_COLOCATED]
        assert all(r.outcome == "final:FINISH_REASON_LENGTH" for r in results)
        return [r.tokens for r in results]

    outputs = asyncio.run(scenario())
    reference = reference_llm.generate(
        PROMPTS, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    )
    assert outputs == [list(r.token_ids) for r in reference]


@pytest.mark.slow
def test_losing_one_rank_replaces_the_whole_worker(service: ServiceProcess) -> None:
    followers = _pids("TPFollower")
    assert len(followers) == 2, followers
    [leader] = _pids("ColocatedWorker")

    async def scenario() -> None:
        os.kill(followers[1], signal.SIGKILL)
        deadline = asyncio.get_running_loop().time() + 120
        while True:
            stats = await get_pool_stats(service.address)
            replaced = set(_pids("ColocatedWorker")) - {leader}
            if replaced and stats.workers:
                break
            assert asyncio.get_running_loop().time() < deadline, "no replacement in 120 s"
            await asyncio.sleep(0.5)
        result = await generate(
            service.address, prompt=PROMPTS[0], max_tokens=6, temperature=0.0, ignore_eos=True
        )
        assert result.outcome == "final:FINISH_REASON_LENGTH"
        await assert_pools_empty(service.address, pools={pb.POOL_COLOCATED})

    asyncio.run(scenario())
    # The dead group's other ranks are gone too; the new group has two of its own.
    survivors = [pid for pid in [leader, *followers] if os.path.exists(f"/proc/{pid}")]
    assert survivors == []
    assert len(_pids("TPFollower")) == 2
