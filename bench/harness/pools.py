"""The service's pools seen from outside (AdminService): the live workers, and the wait
for a pool size. (The tests' leak check is in tests/services.py.)"""

from __future__ import annotations

from bench.harness.polling import wait_until_async
from pdserve.v1 import admin_pb2 as admin_pb
from router.cli.admin_client import list_workers


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
