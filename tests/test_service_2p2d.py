"""Colocated replicas behind the router: requests spread over both, outputs unchanged.

The service is also the one that checks `pdserve serve` without --ray-address starts its
own Ray, whatever a past `ray start` left (one start-up checks both; every other
end-to-end service joins the session's Ray).

(2 prefill + 2 decode workers: tests/test_pools_e2e.py.)"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.harness import ServiceProcess
from bench.harness.streams import generate
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from pdserve.v1 import generation_pb2 as pb
from router.cli.client import get_pool_stats
from tests.services import StartService, assert_pools_empty

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def colocated_service(start_service: StartService) -> Iterator[ServiceProcess]:
    # Ray looks for the last `ray start` in $RAY_TMPDIR/ray/ray_current_cluster; point it
    # at a head that is gone. A short directory: Ray's socket paths must stay < 108 bytes.
    ray_tmp = Path(tempfile.mkdtemp(prefix="pdray-"))
    (ray_tmp / "ray").mkdir()
    (ray_tmp / "ray" / "ray_current_cluster").write_text("127.0.0.1:9\n")
    try:
        svc = start_service(
            ["--colocated-workers", "2", "--decode-kv-cache-gib", "0.1"],
            name="svc-colo",
            env={"RAY_TMPDIR": str(ray_tmp)},
        )
        yield svc
        svc.stop()  # before its Ray directory goes; start_service checks the exit code
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def test_colocated_replicas_behind_the_router(
    colocated_service: ServiceProcess, reference_llm: LLM
) -> None:
    prompts = [f"Tell me about the number {i}." for i in range(6)]
    address = colocated_service.address

    async def scenario() -> list[list[int]]:
        before = await get_pool_stats(address)
        queried = {w.index: w.prefix_query_tokens for w in before.workers}
        results = await asyncio.gather(
            *(
                generate(address, prompt=p, max_tokens=12, temperature=0.0, ignore_eos=True)
                for p in prompts
            )
        )
        stats = await assert_pools_empty(address, pools={pb.POOL_COLOCATED})
        assert {w.pool for w in stats.workers} == {pb.POOL_COLOCATED}
        assert len(stats.workers) == 2
        # Both replicas looked prompts up in their caches during this burst: both served.
        assert all(w.prefix_query_tokens > queried[w.index] for w in stats.workers), stats
        assert all(r.outcome == "final:FINISH_REASON_LENGTH" for r in results)
        return [r.tokens for r in results]

    outputs = asyncio.run(scenario())
    reference = reference_llm.generate(
        prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    )
    assert outputs == [list(r.token_ids) for r in reference]


def test_stale_ray_address_file_does_not_stop_serve(colocated_service: ServiceProcess) -> None:
    # The fixture's service started (its own Ray, despite the stale file) and serves.
    result = asyncio.run(generate(colocated_service.address, prompt="Hi", max_tokens=3))
    assert result.outcome == "final:FINISH_REASON_LENGTH"
    assert len(result.tokens) == 3
