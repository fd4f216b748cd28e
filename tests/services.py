"""What end-to-end tests add to bench.harness: a service started and SERVING for a block
(`running_service`), the type of the fixture that starts them (`StartService`), and the
leak check (`assert_pools_empty`).

`assert_pools_empty` is the service-level counterpart of vLLM's `assert_scheduler_empty`:
once every request has ended, every worker of both pools must get back to zero blocks in
use and the router to nothing in flight or queued. Blocks are released just after a
request's final message (the worker hears of the end a moment later), so the check polls
until a deadline instead of reading once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.harness.service import ServiceProcess, service_process
from pdserve.v1 import generation_pb2 as pb
from router.cli.client import get_pool_stats

# What tests get to start services with: `start(args, name=..., env=..., timeout=...)`.
StartService = Callable[..., ServiceProcess]


@contextmanager
def running_service(
    args: list[str], log_path: Path, *, env: dict[str, str] | None = None, timeout: float = 300.0
) -> Iterator[ServiceProcess]:
    """`service_process`, SERVING when the block starts."""
    with service_process(args, log_path, env=env) as svc:
        svc.wait_serving(timeout)
        yield svc


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
