"""Client side of AdminService: `pdserve scale` and `pdserve workers`."""

from __future__ import annotations

import argparse
import sys

import grpc

from pdserve.v1 import admin_pb2 as pb
from pdserve.v1 import admin_pb2_grpc as pb_grpc
from router.client import ClientSecurity, add_security_arguments, parse_target
from router.flag_types import at_least
from router.flags import POOLS

# Scaling waits for new workers to load their model, or old ones to drain.
SCALE_TIMEOUT_S = 900.0


async def list_workers(
    target: str, security: ClientSecurity | None = None, timeout: float = 10.0
) -> pb.ListWorkersResponse:
    security = security or ClientSecurity()
    async with security.channel(target) as channel:
        return await pb_grpc.AdminServiceStub(channel).ListWorkers(
            pb.ListWorkersRequest(), timeout=timeout, metadata=security.metadata()
        )


async def scale_pool(
    target: str,
    pool: str,
    size: int,
    security: ClientSecurity | None = None,
    timeout: float = SCALE_TIMEOUT_S,
) -> pb.ScalePoolResponse:
    security = security or ClientSecurity()
    async with security.channel(target) as channel:
        return await pb_grpc.AdminServiceStub(channel).ScalePool(
            pb.ScalePoolRequest(pool=pool, size=size), timeout=timeout, metadata=security.metadata()
        )


async def drain_worker(
    target: str, worker_id: str, security: ClientSecurity | None = None
) -> pb.DrainWorkerResponse:
    security = security or ClientSecurity()
    async with security.channel(target) as channel:
        return await pb_grpc.AdminServiceStub(channel).DrainWorker(
            pb.DrainWorkerRequest(worker_id=worker_id),
            timeout=SCALE_TIMEOUT_S,
            metadata=security.metadata(),
        )


def add_admin_arguments(scale: argparse.ArgumentParser, workers: argparse.ArgumentParser) -> None:
    """Flags of `pdserve scale` and `pdserve workers`."""
    for parser in (scale, workers):
        parser.add_argument(
            "--server", type=parse_target, required=True, help="router address, HOST:PORT"
        )
        add_security_arguments(parser)
    for pool in POOLS:
        scale.add_argument(f"--{pool}", type=at_least(0), metavar="N", help=f"{pool} pool size")
    scale.add_argument("--drain", metavar="WORKER_ID", help="drain one worker (e.g. decode-1)")


# Epochs are 62 random bits in hex: padded to 16 digits, one incarnation's epoch lines up
# with the next one's.
EPOCH_WIDTH = 16


def _sort_key(w: pb.WorkerDescription) -> tuple[int, str, int]:
    rank = POOLS.index(w.pool) if w.pool in POOLS else len(POOLS)
    return (rank, w.pool, w.index)


def _table(workers: list[pb.WorkerDescription]) -> str:
    """Workers by pool (prefill, decode, colocated), then index, as aligned columns."""
    rows = [("worker", "state", "epoch", "in flight", "device", "node", "peers")]
    for w in sorted(workers, key=_sort_key):
        state = pb.WorkerState.Name(w.state).removeprefix("WORKER_STATE_").lower()
        rows.append(
            (
                w.worker_id,
                state,
                w.epoch.rjust(EPOCH_WIDTH, "0"),
                str(w.num_in_flight),
                w.device,
                w.node_ip,
                ",".join(w.peers),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ("  ".join(c.ljust(n) for c, n in zip(r, widths, strict=True)) for r in rows)
    return "\n".join(line.rstrip() for line in lines)


async def run_admin(ns: argparse.Namespace, security: ClientSecurity | None = None) -> int:
    """`pdserve scale` / `pdserve workers`: act, then print the workers; the exit status."""
    security = security or ClientSecurity.from_args(ns)
    try:
        if ns.command == "scale":
            sizes = {p: getattr(ns, p) for p in POOLS}
            requested = {p: n for p, n in sizes.items() if n is not None}
            if ns.drain:
                await drain_worker(ns.server, ns.drain, security)
            for pool, size in requested.items():
                await scale_pool(ns.server, pool, size, security)
        listing = await list_workers(ns.server, security)
    except grpc.aio.AioRpcError as exc:
        print(f"pdserve {ns.command}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    print(_table(list(listing.workers)))
    return 0
