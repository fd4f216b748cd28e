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

from engine.factory import EngineArgs
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from pdserve.v1 import generation_pb2 as pb
from router.client import get_pool_stats, stream_generate
from tests.service import ServiceProcess

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def colocated_service(
    tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path
) -> Iterator[ServiceProcess]:
    # Ray looks for the last `ray start` in $RAY_TMPDIR/ray/ray_current_cluster; point it
    # at a head that is gone. A short directory: Ray's socket paths must stay < 108 bytes.
    ray_tmp = Path(tempfile.mkdtemp(prefix="pdray-"))
    (ray_tmp / "ray").mkdir()
    (ray_tmp / "ray" / "ray_current_cluster").write_text("127.0.0.1:9\n")
    svc = ServiceProcess(
        ["--colocated-workers", "2", "--decode-kv-cache-gib", "0.1"],
        tmp_path_factory.mktemp("svc-colo") / "service.log",
        env={"RAY_TMPDIR": str(ray_tmp)},
    )
    try:
        svc.wait_serving()
        yield svc
    finally:
        code = svc.stop()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert code == 0, svc.log_tail()


def test_colocated_replicas_behind_the_router(colocated_service: ServiceProcess) -> None:
    prompts = [f"Tell me about the number {i}." for i in range(6)]

    async def scenario() -> list[list[int]]:
        async def one(p: str) -> list[int]:
            tokens: list[int] = []
            async for resp in stream_generate(
                colocated_service.address, prompt=p, max_tokens=12, temperature=0.0, ignore_eos=True
            ):
                tokens.extend(resp.token_ids)
            return tokens

        return await asyncio.gather(*(one(p) for p in prompts))

    outputs = asyncio.run(scenario())
    stats = asyncio.run(get_pool_stats(colocated_service.address))
    assert {w.pool for w in stats.workers} == {pb.POOL_COLOCATED}
    assert all(w.prefix_query_tokens > 0 for w in stats.workers), "both replicas served"
    assert all(w.num_blocks_in_use == 0 for w in stats.workers)
    reference = LLM(EngineArgs(kv_cache_gib=0.1)).generate(
        prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    )
    assert outputs == [list(r.token_ids) for r in reference]


# After the test above: this request would count as a replica having served there.
def test_stale_ray_address_file_does_not_stop_serve(colocated_service: ServiceProcess) -> None:
    async def one() -> list[pb.GenerateResponse]:
        return [
            r async for r in stream_generate(colocated_service.address, prompt="Hi", max_tokens=3)
        ]

    responses = asyncio.run(one())
    assert responses[-1].finish_reason != 0
