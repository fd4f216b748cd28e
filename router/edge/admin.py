"""AdminService: list, scale and drain workers, move requests between decode workers,
set the local-prefill policy, and show the planner's last decision, while serving.

Always registered (so reflection shows it), refused with PERMISSION_DENIED unless the
server was started with --enable-admin. Bearer-token auth, when on, covers it like
every other RPC.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

import grpc

from engine.wire import POOLS, PoolName, epoch_hex
from pdserve.v1 import admin_pb2 as pb
from pdserve.v1 import admin_pb2_grpc as pb_grpc
from router.fleet.pool_sizes import pool_size_problem
from router.routing.prefill_policy import PrefillPolicyConfig

if TYPE_CHECKING:  # the server answers (NOT_SERVING) before Ray and torch are imported
    from router.fleet.worker_ref import WorkerRef
    from router.planner.loop import PlannerLoop
    from router.serving.live_migration import LiveMigrator, MoveResult

log = logging.getLogger(__name__)

ADMIN_SERVICE = pb.DESCRIPTOR.services_by_name["AdminService"].full_name
_STATES = {
    "starting": pb.WORKER_STATE_STARTING,
    "live": pb.WORKER_STATE_LIVE,
    "draining": pb.WORKER_STATE_DRAINING,
}


def describe(ref: WorkerRef) -> pb.WorkerDescription:
    return pb.WorkerDescription(
        worker_id=ref.worker_id,
        pool=ref.pool,
        index=ref.index,
        state=_STATES.get(ref.state, pb.WORKER_STATE_UNSPECIFIED),
        epoch=epoch_hex(ref.info.epoch),
        device=ref.info.device,
        node_ip=ref.info.node_ip,
        pid=ref.info.pid,
        num_in_flight=max(ref.load.service_assigned, 0),
        peers=sorted(ref.peers),
        tensor_parallel_size=ref.info.tensor_parallel_size,
        gpu_ids=list(ref.info.gpu_ids),
    )


def planner_status(planner: PlannerLoop) -> pb.PlannerStatus:
    """The planner's budget and its last decision, for ListWorkers."""
    status = pb.PlannerStatus(
        max_workers=planner.config.max_workers, interval_seconds=planner.config.interval_s
    )
    decision = planner.last
    if decision is None:
        return status
    status.seconds_since_decision = max(planner.clock() - decision.at, 1e-3)
    status.traffic = decision.traffic
    for d in decision.pools:
        entry = status.pools.add(
            pool=d.pool,
            current=d.current,
            target=d.target,
            action=d.action,
            reason=d.reason,
            detail=d.detail,
        )
        if d.load is not None:
            entry.load_workers = d.load
    return status


class AdminPools(Protocol):
    """What the admin API reads and changes on the pools (router.fleet.pools.Pools)."""

    @property
    def targets(self) -> Mapping[str, int]: ...
    @property
    def workers(self) -> Mapping[str, Sequence[WorkerRef]]: ...
    @property
    def num_restarts(self) -> int: ...
    def all(self) -> Sequence[WorkerRef]: ...
    def routable(self, pool: PoolName) -> Sequence[WorkerRef]: ...
    def find(self, worker_id: str) -> WorkerRef | None: ...
    async def scale(self, pool: str, size: int) -> None: ...
    async def drain(self, worker_id: str) -> None: ...


class Rebalancer(Protocol):
    """Moves up to `max_requests` (None: all) requests off a decode worker."""

    async def rebalance(self, source: WorkerRef, max_requests: int | None) -> MoveResult: ...


class PolicyHolder(Protocol):
    """The serving core's side of SetPrefillPolicy and MigrateRequests."""

    prefill_policy: PrefillPolicyConfig
    live_migration: LiveMigrator | None  # None: colocated replicas, nothing to move

    def set_prefill_policy(self, config: PrefillPolicyConfig) -> None: ...


async def _find(pools: AdminPools, worker_id: str, context: grpc.aio.ServicerContext) -> WorkerRef:
    """The worker named, or the call ends with NOT_FOUND."""
    ref = pools.find(worker_id)
    if ref is None:
        await context.abort(grpc.StatusCode.NOT_FOUND, f"no worker {worker_id!r}")
    assert ref is not None
    return ref


class AdminServicer(pb_grpc.AdminServiceServicer):
    def __init__(
        self,
        pools: Callable[[], AdminPools | None],
        enabled: bool,
        core: Callable[[], PolicyHolder | None] = lambda: None,
        planner: Callable[[], PlannerLoop | None] = lambda: None,
    ) -> None:
        self._pools = pools
        self._core = core
        self._planner = planner
        self.enabled = enabled
        # MigrateRequests across a router tier (router/tier/rebalance.py); None: the
        # serving core's own requests are all there are.
        self.rebalancer: Rebalancer | None = None

    async def _check(self, context: grpc.aio.ServicerContext) -> AdminPools:
        if not self.enabled:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                "the admin API is disabled; start the server with --enable-admin",
            )
        pools = self._pools()
        if pools is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "pools are still starting")
        assert pools is not None
        return pools

    async def ListWorkers(
        self, request: pb.ListWorkersRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListWorkersResponse:
        pools = await self._check(context)
        planner = self._planner()
        return pb.ListWorkersResponse(
            workers=[describe(w) for w in pools.all()],
            targets=dict(pools.targets),
            num_restarts=pools.num_restarts,
            planner=planner_status(planner) if planner is not None else None,
        )

    async def ScalePool(
        self, request: pb.ScalePoolRequest, context: grpc.aio.ServicerContext
    ) -> pb.ScalePoolResponse:
        pools = await self._check(context)
        active = [p for p in POOLS if pools.targets[p] > 0]
        if request.pool not in POOLS:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"pool must be one of {', '.join(POOLS)}, got {request.pool!r}",
            )
        if request.pool not in active:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"this deployment runs the {' and '.join(active)} pools, not {request.pool}",
            )
        if self._planner() is not None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "the planner sizes the pools (--planner): it would undo this at its next "
                "decision; restart without --planner to size them by hand",
            )
        size_problem = pool_size_problem(request.size)
        if size_problem is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, size_problem)
        log.info("scaling %s to %d", request.pool, request.size)
        try:
            await pools.scale(request.pool, request.size)
        except Exception as exc:  # noqa: BLE001 - reported to the operator
            await context.abort(grpc.StatusCode.INTERNAL, f"scaling failed: {exc}")
        return pb.ScalePoolResponse(workers=[describe(w) for w in pools.workers[request.pool]])

    async def DrainWorker(
        self, request: pb.DrainWorkerRequest, context: grpc.aio.ServicerContext
    ) -> pb.DrainWorkerResponse:
        pools = await self._check(context)
        ref = await _find(pools, request.worker_id, context)
        live = [w for w in pools.routable(ref.pool) if w is not ref]
        if ref.alive and not live:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{ref.worker_id} is the last live {ref.pool} worker",
            )
        await pools.drain(request.worker_id)
        return pb.DrainWorkerResponse()

    async def MigrateRequests(
        self, request: pb.MigrateRequestsRequest, context: grpc.aio.ServicerContext
    ) -> pb.MigrateRequestsResponse:
        pools = await self._check(context)
        ref = await _find(pools, request.worker_id, context)
        if ref.pool != "decode":
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"requests move with their KV between decode workers; {ref.worker_id} is a "
                f"{ref.pool} worker",
            )
        if not ref.alive or not [w for w in pools.routable(PoolName.DECODE) if w is not ref]:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{ref.worker_id} is {ref.state}"
                if not ref.alive
                else "no other live decode worker to take its requests",
            )
        core = self._core()
        mover = core.live_migration if core is not None else None
        if mover is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the serving core is starting")
        assert mover is not None
        result = await (self.rebalancer or mover).rebalance(ref, request.max_requests or None)
        return pb.MigrateRequestsResponse(
            num_candidates=result.num_candidates,
            moved_with_kv=result.with_kv,
            moved_by_recompute=result.by_recompute,
        )

    async def SetPrefillPolicy(
        self, request: pb.SetPrefillPolicyRequest, context: grpc.aio.ServicerContext
    ) -> pb.SetPrefillPolicyResponse:
        await self._check(context)
        core = self._core()
        if core is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the serving core is starting")
        assert core is not None
        changes = {
            name: getattr(request, name)
            for name in ("local_prefill_max_tokens", "slo_ttft_ms", "slo_tpot_ms")
            if request.HasField(name)
        }
        if changes:
            try:
                policy = replace(core.prefill_policy, **changes)
            except ValueError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            core.set_prefill_policy(policy)
        now = core.prefill_policy
        return pb.SetPrefillPolicyResponse(
            policy=pb.PrefillPolicy(
                local_prefill_max_tokens=now.local_prefill_max_tokens,
                slo_ttft_ms=now.slo_ttft_ms,
                slo_tpot_ms=now.slo_tpot_ms,
            )
        )
