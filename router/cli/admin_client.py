"""Client side of AdminService: `pdserve scale`, `pdserve workers` (with the planner's
last decision) and `pdserve prefill-policy`."""

from __future__ import annotations

import argparse
import sys

import grpc

from engine.wire import EPOCH_HEX_DIGITS, POOLS
from pdserve.v1 import admin_pb2 as pb
from pdserve.v1 import admin_pb2_grpc as pb_grpc
from router.cli.client import ClientSecurity, add_security_arguments, parse_target
from router.cli.flag_types import at_least, number_in, pool_size

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


async def migrate_requests(
    target: str,
    worker_id: str,
    max_requests: int = 0,
    security: ClientSecurity | None = None,
) -> pb.MigrateRequestsResponse:
    security = security or ClientSecurity()
    async with security.channel(target) as channel:
        return await pb_grpc.AdminServiceStub(channel).MigrateRequests(
            pb.MigrateRequestsRequest(worker_id=worker_id, max_requests=max_requests),
            timeout=SCALE_TIMEOUT_S,
            metadata=security.metadata(),
        )


async def set_prefill_policy(
    target: str, request: pb.SetPrefillPolicyRequest, security: ClientSecurity | None = None
) -> pb.SetPrefillPolicyResponse:
    security = security or ClientSecurity()
    async with security.channel(target) as channel:
        return await pb_grpc.AdminServiceStub(channel).SetPrefillPolicy(
            request, timeout=10.0, metadata=security.metadata()
        )


def add_admin_arguments(
    scale: argparse.ArgumentParser,
    workers: argparse.ArgumentParser,
    policy: argparse.ArgumentParser,
) -> None:
    """Flags of `pdserve scale`, `pdserve workers` and `pdserve prefill-policy`."""
    for parser in (scale, workers, policy):
        parser.add_argument(
            "--server", type=parse_target, required=True, help="router address, HOST:PORT"
        )
        add_security_arguments(parser)
    for pool in POOLS:
        scale.add_argument(f"--{pool}", type=pool_size, metavar="N", help=f"{pool} pool size")
    scale.add_argument("--drain", metavar="WORKER_ID", help="drain one worker (e.g. decode-1)")
    scale.add_argument(
        "--migrate",
        metavar="WORKER_ID",
        help="move running requests off one decode worker to the others, with their KV, "
        "while it stays in service (rebalancing)",
    )
    scale.add_argument(
        "--max-requests",
        type=at_least(1),
        metavar="N",
        help="with --migrate: at most N requests, the largest token budgets first (default: all)",
    )
    # Each one given is set; none given: the policy is shown, unchanged.
    policy.add_argument(
        "--local-prefill-max-tokens",
        type=at_least(0),
        metavar="N",
        help="set serve's --local-prefill-max-tokens (default: unchanged)",
    )
    policy.add_argument(
        "--slo-ttft-ms",
        type=number_in(0, open_low=True),
        metavar="MS",
        help="set serve's --slo-ttft-ms (default: unchanged)",
    )
    policy.add_argument(
        "--slo-tpot-ms",
        type=number_in(0, open_low=True),
        metavar="MS",
        help="set serve's --slo-tpot-ms (default: unchanged)",
    )


def _sort_key(w: pb.WorkerDescription) -> tuple[int, str, int]:
    rank = POOLS.index(w.pool) if w.pool in POOLS else len(POOLS)
    return (rank, w.pool, w.index)


def _table(workers: list[pb.WorkerDescription]) -> str:
    """Workers by pool (prefill, decode, colocated), then index, as aligned columns."""
    rows = [("worker", "state", "epoch", "in flight", "device", "tp", "gpus", "node", "peers")]
    for w in sorted(workers, key=_sort_key):
        state = pb.WorkerState.Name(w.state).removeprefix("WORKER_STATE_").lower()
        rows.append(
            (
                w.worker_id,
                state,
                w.epoch.rjust(
                    EPOCH_HEX_DIGITS, "0"
                ),  # as the server formats it (older ones did not pad)
                str(w.num_in_flight),
                w.device,
                str(w.tensor_parallel_size or 1),
                ",".join(map(str, w.gpu_ids)) or "-",
                w.node_ip,
                ",".join(w.peers),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ("  ".join(c.ljust(n) for c, n in zip(r, widths, strict=True)) for r in rows)
    return "\n".join(line.rstrip() for line in lines)


def _planner_lines(status: pb.PlannerStatus) -> list[str]:
    """The planner's last decision: when, what it measured, and each pool's verdict."""
    head = f"planner: budget {status.max_workers} workers, every {status.interval_seconds:g} s"
    if not status.pools:
        return [f"{head}; no decision yet"]
    lines = [f"{head}; last decision {status.seconds_since_decision:.0f} s ago: {status.traffic}"]
    for d in status.pools:
        size = str(d.current) if d.current == d.target else f"{d.current} -> {d.target}"
        lines.append(f"  {d.pool} {size}: {d.action} ({d.reason}); {d.detail}")
    return lines


def _policy_line(policy: pb.PrefillPolicy) -> str:
    return (
        f"local_prefill_max_tokens={policy.local_prefill_max_tokens} "
        f"slo_ttft_ms={policy.slo_ttft_ms:g} slo_tpot_ms={policy.slo_tpot_ms:g}"
    )


async def run_admin(ns: argparse.Namespace, security: ClientSecurity | None = None) -> int:
    """`pdserve scale` / `workers` / `prefill-policy`: act, then print the workers (or
    the policy now in effect); the exit status."""
    security = security or ClientSecurity.from_args(ns)
    try:
        if ns.command == "prefill-policy":
            fields = ("local_prefill_max_tokens", "slo_ttft_ms", "slo_tpot_ms")
            changes = {f: getattr(ns, f) for f in fields if getattr(ns, f) is not None}
            reply = await set_prefill_policy(
                ns.server, pb.SetPrefillPolicyRequest(**changes), security
            )
            print(_policy_line(reply.policy))
            return 0
        if ns.command == "scale":
            sizes = {p: getattr(ns, p) for p in POOLS}
            requested = {p: n for p, n in sizes.items() if n is not None}
            if ns.migrate:
                moved = await migrate_requests(
                    ns.server, ns.migrate, ns.max_requests or 0, security
                )
                print(
                    f"{ns.migrate}: {moved.moved_with_kv} of {moved.num_candidates} requests "
                    f"moved with their KV, {moved.moved_by_recompute} by recompute"
                )
            if ns.drain:
                await drain_worker(ns.server, ns.drain, security)
            for pool, size in requested.items():
                await scale_pool(ns.server, pool, size, security)
        listing = await list_workers(ns.server, security)
    except grpc.aio.AioRpcError as exc:
        print(f"pdserve {ns.command}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    print(_table(list(listing.workers)))
    if listing.HasField("planner"):
        print("\n".join(_planner_lines(listing.planner)))
    return 0
