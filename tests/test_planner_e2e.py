"""The planner on the real service (CPU, the embedded model): `--planner --max-gpus 4`
starting at 1 prefill + 1 decode worker. A closed loop of long prompts with one-token
answers keeps the prefill pool far past a tight TTFT target while the decode pool meets
its TPOT target: the planner grows the prefill pool (not decode), and once the load stops
it drains back to one worker each. Every request completes, and no block stays in use.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from bench.harness import ServiceProcess, wait_until_async
from bench.harness.metrics import scrape, value
from bench.harness.pools import wait_pool_sizes
from bench.harness.streams import StreamResult, generate
from pdserve.v1 import generation_pb2 as pb
from router.cli.admin_client import list_workers
from tests.services import StartService, assert_pools_empty

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPT_TOKENS = 256
CLIENTS = 6


@pytest.fixture(scope="module")
def service(start_service: StartService, ray_session: str) -> ServiceProcess:
    return start_service(
        [
            "--ray-address",
            ray_session,
            "--enable-admin",
            "--planner",
            "--max-gpus",
            "4",
            "--planner-interval-s",
            "1",
            "--planner-cooldown-s",
            "3",
            # One 256-token prompt alone takes longer than this on CPU: prefill misses it.
            "--slo-ttft-ms",
            "300",
            "--slo-tpot-ms",
            "5000",
            "--local-prefill-max-tokens",  # every prompt goes to the prefill pool
            "0",
            "--prefill-kv-cache-gib",
            "0.2",
            "--decode-kv-cache-gib",
            "0.2",
        ],
        name="svc-planner",
    )


async def _targets(address: str) -> dict[str, int]:
    listing = await list_workers(address)
    return dict(listing.targets)


def test_an_overloaded_prefill_pool_grows_then_drains_back_when_the_load_stops(
    service: ServiceProcess,
) -> None:
    async def body() -> None:
        rng = random.Random(7)
        stop = asyncio.Event()
        results: list[StreamResult] = []

        async def client() -> None:
            while not stop.is_set():
                prompt = [rng.randrange(1000, 20000) for _ in range(PROMPT_TOKENS)]
                results.append(
                    await generate(
                        service.address,
                        prompt_token_ids=prompt,
                        max_tokens=2,
                        temperature=0.0,
                        ignore_eos=True,
                        timeout=600,
                    )
                )

        clients = [asyncio.create_task(client()) for _ in range(CLIENTS)]

        async def prefill_grown() -> bool:
            return (await _targets(service.address))["prefill"] >= 2

        try:
            # The overload must outlast a worker's start-up before the planner adds one.
            await wait_until_async(prefill_grown, 480, interval=0.5, what="prefill pool grown")
        finally:
            stop.set()
            await asyncio.gather(*clients)
        outcomes = {r.outcome for r in results}
        assert outcomes == {"final:FINISH_REASON_LENGTH"}, [r for r in results if r.final is None]

        # The load stopped: the added workers arrive, then drain away after a cool-down.
        async def back_to_minimum() -> bool:
            return await _targets(service.address) == {"prefill": 1, "decode": 1, "colocated": 0}

        await wait_until_async(back_to_minimum, 480, interval=0.5, what="targets back at 1P1D")
        listing = await wait_pool_sizes(service.address, 1, 1, timeout=60)
        assert listing.planner.max_workers == 4
        decode = next(p for p in listing.planner.pools if p.pool == "decode")
        assert decode.current == 1
        await assert_pools_empty(service.address, pools={pb.POOL_PREFILL, pb.POOL_DECODE})
        _, samples, _ = scrape(service.metrics_port)

        def decisions(pool: str, action: str, reason: str) -> float:
            return value(
                samples, "pdserve_planner_decisions_total", pool=pool, action=action, reason=reason
            )

        grown = sum(
            decisions("prefill", "scale_up", reason) for reason in ("capacity_short", "ttft_missed")
        )
        assert grown >= 1
        assert decisions("prefill", "scale_down", "idle") >= 1
        # The pool that met its target was left alone.
        assert (
            sum(
                decisions("decode", "scale_up", reason)
                for reason in ("capacity_short", "tpot_missed", "kv_full", "ttft_missed")
            )
            == 0
        )
        assert value(samples, "pdserve_planner_target_workers", pool="prefill") == 1

    asyncio.run(body())
