"""A freshly started service (1 prefill + 1 decode on CPU) places a burst of long prompts
by load from its very first request: each worker measured its speed as it warmed up."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from bench.harness import ServiceProcess
from bench.harness.metrics import prefill_paths, scrape, value
from bench.harness.streams import generate
from tests.services import StartService

pytestmark = pytest.mark.e2e

TOPIC = (
    "Describe the rivers, mountains, lakes, forests and coastlines of country number {i}, "
    "with two examples for each and a sentence on how people live near them. "
)
NUM_PROMPTS = 4


@pytest.fixture(scope="module")
def service(start_service: StartService, ray_session: str) -> ServiceProcess:
    return start_service(
        [
            "--ray-address",
            ray_session,
            "--prefill-kv-cache-gib",
            "0.1",
            "--decode-kv-cache-gib",
            "0.1",
        ],
        name="svc-warm-up",
    )


def test_the_first_burst_is_placed_by_the_speeds_measured_at_warm_up(
    service: ServiceProcess,
) -> None:
    _, samples, _ = scrape(service.metrics_port)
    # The warm-up left nothing behind: no block in use on either worker.
    for pool in ("prefill", "decode"):
        ratio = value(samples, "pdserve_kv_cache_usage_ratio", pool=pool, worker="0")
        assert ratio == 0, (pool, ratio)
    assert not prefill_paths({}, samples), "a request was placed before the burst"
    log = service.log_tail(200_000)
    for worker in ("prefill-0", "decode-0"):
        assert f"({worker}: a prompt of" in log, f"{worker} logged no warm-up speed"

    async def burst() -> None:
        prompts = [TOPIC.format(i=i) * 3 for i in range(NUM_PROMPTS)]  # ~100 tokens each
        results = await asyncio.gather(
            *(generate(service.address, prompt=p, max_tokens=4, temperature=0.0) for p in prompts)
        )
        for result in results:
            assert result.code == grpc.StatusCode.OK and result.final is not None, result

    asyncio.run(burst())
    _, after, _ = scrape(service.metrics_port)
    paths = prefill_paths({}, after)
    assert sum(paths.values()) == NUM_PROMPTS, paths
    assert "remote/no_estimate" not in paths, paths
    assert "local/short_prompt" not in paths, paths  # long prompts: the load decides
