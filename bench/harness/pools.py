"""The service's pools seen from outside: the leak check and the wait for a pool size.

`assert_pools_empty` is the service-level counterpart of vLLM's `assert_scheduler_empty`:
once every request has ended, every worker of both pools must get back to zero blocks in
use and the router to nothing in flight or queued. Blocks are released just after a
request's final message (the worker hears of the end a moment later), so the check polls
until a deadline instead of reading once.
"""

from __future__ import annotations

import asyncio

from bench.harness.polling import wait_until_async
from pdserve.v1 import admin_pb2 as admin_pb
from pdserve.v1 import generation_pb2 as pb
from router.cli.admin_client import list_workers
from router.cli.client import get_pool_stats


def _in_use(stats: pb.GetPoolStatsResponse) -> list[str]:
    """What still holds something: 'decode-0: 3 blocks', 'router: 1 in flight'."""
    held = [
        f"{pb.Pool.Name(w.pool).removeprefix('POOL_').lower()}-{w.index}: "
        f"{w.num_blocks_in_use} blocks, {w.num_running} running, {w.num_waiting} waiting"
        for w in stats.workers
        if w.num_blocks_in_use or w.num_running or w.num_waiting
    ]
    if stats.num_in_flight or stats.num_queued:
        held.append(f"router: {stats.num_in_flight} in flight, {stats.num_queued} queued")
    return held


async def assert_pools_empty(
    address: str, *, timeout: float = 30.0, pools: set[int] | None = None
) -> pb.GetPoolStatsResponse:
    """Wait until no worker holds a block or a request and the router holds none; the
    stats then. AssertionError naming what is still held after `timeout` seconds.

    `pools` (e.g. {POOL_PREFILL, POOL_DECODE}): the pools that must be there, so that a
    check that sees no workers at all does not pass."""
    stats = await get_pool_stats(address)
    deadline = asyncio.get_running_loop().time() + timeout
    while _in_use(stats):
        if asyncio.get_running_loop().time() >= deadline:
            raise AssertionError(f"still in use after {timeout:g} s: {'; '.join(_in_use(stats))}")
        await asyncio.sleep(0.1)
        stats = await get_pool_stats(address)
    if pools is not None:
        present = {w.pool for w in stats.workers}
        assert pools <= present, f"pools {pools - present} have no workers: {stats}"
    return stats


async def live_workers(address: str, pool: str | None = None) -> list[admin_pb.WorkerDescription]:
    """The live workers (AdminService), of `pool` ("prefill", "decode") or of every pool."""
    listing = await list_workers(address)
    return [
        w
        for w in listing.workers
        if w.state == admin_pb.WORKER_STATE_LIVE and pool in (None, w.pool)
    ]


async def wait_pool_sizes(
    address: str, prefill: int, decode: int, *, timeout: float = 180.0
) -> admin_pb.ListWorkersResponse:
    """Wait (AdminService) until exactly `prefill` and `decode` workers are live and every
    live pair has its channel; the listing then."""

    async def at_size() -> admin_pb.ListWorkersResponse | None:
        listing = await list_workers(address)
        live = [w for w in listing.workers if w.state == admin_pb.WORKER_STATE_LIVE]
        pools = [w.pool for w in live]
        paired = all(len(w.peers) == (decode if w.pool == "prefill" else prefill) for w in live)
        sized = pools.count("prefill") == prefill and pools.count("decode") == decode
        return listing if sized and paired else None

    return await wait_until_async(
        at_size, timeout, interval=0.5, what=f"pools at {prefill}P{decode}D, all paired"
    )
