"""The main job: listen at once, start Ray and the pools, serve gRPC, drain on SIGTERM,
stop the pools.

Only light modules are imported at the top: the gRPC server listens and answers
NOT_SERVING (Generate: UNAVAILABLE) within the process's first second, and Ray, torch
and the serving core are imported and started while it does.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine import tracing
from engine.core.outputs import FinalResult, TextChunk
from router.config import ServeConfig
from router.edge.admin import AdminServicer
from router.edge.grpc_server import GrpcServer, serve
from router.fleet import port_holds
from router.fleet.daemon_calls import call_in_daemon_thread
from router.fleet.local_watch import ray_daemons, watch_processes
from router.observability.fleet_metrics import FleetState, get_fleet_metrics
from router.observability.metrics import get_metrics
from router.observability.phase_metrics import get_phase_metrics
from router.serving.errors import NotReadyError
from router.serving.protocol import GenerateCall, PoolStats, ServerInfo

if TYPE_CHECKING:
    from router.fleet.cluster import Cluster
    from router.fleet.pools import Pools
    from router.planner.loop import PlannerLoop
    from router.serving.orchestrator import DisaggregatedGenerator
    from router.tier.owner import TierOwner
    from router.tier.owner_side import OwnerSide

log = logging.getLogger(__name__)
# Workers stop in well under a second when asked; a shutdown that takes longer is one
# whose Ray stopped answering.
STOP_WORKERS_S = 3.0


class WarmingGenerator:
    """Stands in for the serving core while the pools start: every call is UNAVAILABLE."""

    def __init__(self) -> None:
        self.inner: DisaggregatedGenerator | None = None

    def _core(self) -> DisaggregatedGenerator:
        if self.inner is None:
            raise NotReadyError("pools are still starting")
        return self.inner

    def generate(self, call: GenerateCall) -> AsyncIterator[TextChunk | FinalResult]:
        return self._core().generate(call)

    def server_info(self) -> ServerInfo:
        return self._core().server_info()

    async def pool_stats(self) -> PoolStats:
        return await self._core().pool_stats()

    def is_ready(self) -> bool:
        return self.inner is not None and self.inner.is_ready()


# What the service needs once it listens: Ray, torch, the serving core (seconds to import).
_RUNTIME_MODULES = (
    "router.fleet.cluster",
    "router.tier.owner_side",
    "router.fleet.pools",
    "router.serving.orchestrator",
    "router.planner.loop",
    "router.planner.metrics",
    "engine.model.model_loader",
)


class RayLostError(RuntimeError):
    """The local Ray instance went down while the service was not being stopped."""


@dataclass
class _Runtime:
    """What warm-up makes, for the handlers and the shutdown that may come at any time."""

    cluster: Cluster | None = None
    pools: Pools | None = None
    planner: PlannerLoop | None = None
    tier_owner: TierOwner | None = None  # the other router processes (--router-processes)
    tier: OwnerSide | None = None  # and what this one does for them once its pools run
    ray_lost: str | None = None  # why, once the local Ray is going down
    watcher: asyncio.Task[None] | None = None  # the local Ray's processes, watched


def _import_runtime() -> None:
    for name in _RUNTIME_MODULES:
        importlib.import_module(name)


async def run_service(
    config: ServeConfig,
    on_started: Callable[[GrpcServer], None] | None = None,
    on_cluster: Callable[[Cluster], None] | None = None,
) -> None:
    """Serve until SIGTERM/SIGINT, then drain in-flight requests and stop the workers.

    The gRPC server listens first; Ray (started or joined) and the pools come up behind
    it, and are stopped before this returns. Run it on the main thread: Ray's driver
    aborts at exit when torn down from another one. The Ray cluster is handed to
    `on_cluster` as soon as it exists; when it ends `abandoned`, the caller must exit
    without Ray's teardown at exit (`os._exit`).
    """
    front = WarmingGenerator()
    rt = _Runtime()
    metrics = get_metrics()
    get_phase_metrics()  # their families are on /metrics from the first scrape
    tracing.configure(config.cluster.tracing, "pdserve-router")
    servers: list[GrpcServer] = []
    stop_metrics = _serve_metrics(config, front, rt, servers)

    def started(server: GrpcServer) -> None:
        servers.append(server)
        if on_started is not None:
            on_started(server)

    def ray_going_down(why: str) -> None:
        rt.ray_lost = why
        if rt.cluster is not None:
            rt.cluster.abandon_ray()  # every call to Ray would now wait for a dead GCS
        log.warning("%s; ending the streams in flight now", why)
        for server in servers:
            server.stop_now(f"the workers went down with the service ({why})")

    def on_drain() -> None:
        # The service is going away: a request whose worker is lost ends now (ABORT)
        # rather than moving.
        if front.inner is not None:
            front.inner.begin_shutdown()
        if rt.tier_owner is not None:
            rt.tier_owner.begin_drain("the service is stopping")

    admin = AdminServicer(
        lambda: rt.pools if front.inner is not None else None,
        config.enable_admin,
        lambda: front.inner,
        lambda: rt.planner,
    )
    warm_up = _warm_up(config, rt, front, servers, admin, on_cluster, ray_going_down)
    try:
        await serve(
            front,
            config.host,
            config.port,
            drain_grace_s=config.drain_grace_s,
            warm_up=warm_up,
            on_started=started,
            security=config.security,
            metrics=metrics,
            admin=admin,
            on_drain=on_drain,
            reuse_port=config.router_processes > 1,
        )
    finally:
        if stop_metrics is not None:
            stop_metrics()
        await _stop(config, rt, front)
    if rt.ray_lost is not None and not await _stop_was_asked(servers):
        raise RayLostError(f"the local Ray instance went down: {rt.ray_lost}")


# A stop signal sent to every process of the service (a control-group stop) may reach Ray
# first: the service notices Ray going down and stops before its own signal arrives.
_LATE_SIGNAL_S = 1.0


async def _stop_was_asked(servers: list[GrpcServer]) -> bool:
    """Whether a stop signal reached the service, waiting briefly for one in flight."""
    if not servers:
        return False
    return any(await asyncio.gather(*(s.wait_for_signal(_LATE_SIGNAL_S) for s in servers)))


def _serve_metrics(
    config: ServeConfig, front: WarmingGenerator, rt: _Runtime, servers: list[GrpcServer]
) -> Callable[[], None] | None:
    """/metrics on its port, with the pools' and the fleet's numbers read at scrape time;
    the function that stops it (None: no metrics port)."""
    if not config.metrics_port:
        return None
    metrics = get_metrics()
    loop = asyncio.get_running_loop()
    port_holds.release(config.metrics_host, config.metrics_port)  # held since start
    stop_metrics = metrics.serve(config.metrics_host, config.metrics_port)

    def read_pool_stats() -> PoolStats | None:
        # Called on the metrics server's thread at scrape time.
        if not front.is_ready():
            return None
        future = asyncio.run_coroutine_threadsafe(front.pool_stats(), loop)
        return future.result(timeout=metrics.pools.timeout_s)

    metrics.pools.set_source(read_pool_stats)

    def read_fleet() -> FleetState:
        # Called on the metrics server's thread: plain reads of the pools' counts.
        pools = rt.pools
        if pools is None:
            return FleetState(serving=bool(servers) and servers[0].is_serving)
        return FleetState(
            serving=bool(servers) and servers[0].is_serving,
            target_workers=dict(pools.targets),
            live_workers={pool: len(pools.routable(pool)) for pool in pools.targets},
            tensor_parallel={
                ref.worker_id: (ref.pool, ref.info.tensor_parallel_size)
                for ref in pools.all()
                if ref.state == "live"
            },
        )

    get_fleet_metrics().set_source(read_fleet)
    return stop_metrics


async def _warm_up(
    config: ServeConfig,
    rt: _Runtime,
    front: WarmingGenerator,
    servers: list[GrpcServer],
    admin: AdminServicer,
    on_cluster: Callable[[Cluster], None] | None,
    ray_going_down: Callable[[str], None],
) -> None:
    """Ray, the pools, the serving core (and the router tier and the planner), behind
    the listening server."""
    loop = asyncio.get_running_loop()
    # Off the event loop, which keeps answering health checks meanwhile.
    await call_in_daemon_thread(_import_runtime, "runtime-imports")
    from engine.model.model_loader import has_tokenizer, load_tokenizer
    from router.fleet.cluster import Cluster
    from router.fleet.pools import Pools
    from router.serving.orchestrator import DisaggregatedGenerator
    from router.tier.owner import TierOwner
    from router.tier.owner_side import OwnerSide

    cluster = rt.cluster = Cluster(config.cluster)
    if on_cluster is not None:
        on_cluster(cluster)
    if config.router_processes > 1:
        # They import what they need while Ray and the pools start.
        rt.tier_owner = TierOwner(config, servers[0].port, cluster.call_token)
        await rt.tier_owner.start()
    await cluster.start_ray()
    for server in servers:
        # Ray's driver installs a SIGTERM handler of its own as it connects (a stack
        # dump, then the old handler): the drain's handler comes back first.
        server.install_signal_handlers()
    if cluster.local_ray is not None:
        # Ray's own processes, watched from now on: one of them exiting means Ray is
        # going down (a stop that signalled every process of the service).
        daemons = ray_daemons(cluster.local_ray.session_id)
        rt.watcher = asyncio.ensure_future(watch_processes(daemons, ray_going_down))
    pools = rt.pools = Pools(cluster)
    await pools.start()
    model_path = config.cluster.decode_args.resolve_model_path()
    tokenizer = None
    if has_tokenizer(model_path):
        tokenizer = await loop.run_in_executor(None, load_tokenizer, str(model_path))
    admission = None
    if rt.tier_owner is not None:
        rt.tier = OwnerSide(rt.tier_owner, pools)
        admission = rt.tier.admission
    core = DisaggregatedGenerator(pools, tokenizer, config.router, admission)
    core.start()
    front.inner = core
    if rt.tier is not None:
        await rt.tier.start(core, admin)
    _start_planner(config, rt, core)
    log.info("pools warm; SERVING")


def _start_planner(config: ServeConfig, rt: _Runtime, core: DisaggregatedGenerator) -> None:
    if config.planner is None or rt.pools is None:
        return
    from router.planner.loop import PlannerLoop
    from router.planner.metrics import planner_metrics

    rt.planner = PlannerLoop(
        config.planner,
        rt.pools,
        core if rt.tier is None else rt.tier.planner_core(core),
        max_num_seqs=config.cluster.decode_args.scheduler.max_num_seqs,
        metrics=planner_metrics(get_metrics().registry),
    )
    rt.planner.start()


async def _stop(config: ServeConfig, rt: _Runtime, front: WarmingGenerator) -> None:
    """Everything warm-up started, in the reverse order (whatever part of it ran)."""
    if rt.watcher is not None:
        rt.watcher.cancel()
    get_metrics().pools.set_source(None)
    get_fleet_metrics().set_source(None)
    if rt.planner is not None:
        await rt.planner.stop()
    if rt.tier is not None:
        await rt.tier.stop()
    if rt.tier_owner is not None:
        # The other processes' requests run on the workers: they go first.
        await rt.tier_owner.stop(config.drain_grace_s)
    if front.inner is not None:
        await front.inner.stop()
    pools, cluster = rt.pools, rt.cluster
    if pools is not None and cluster is not None and rt.ray_lost is None:
        # (Once the local Ray is going down there is no one left to ask.)
        workers_stopped = await pools.stop(timeout_s=STOP_WORKERS_S)
        if not workers_stopped:
            cluster.abandon_ray()  # Ray did not answer: leave without its teardown
    if cluster is not None:
        cluster.shutdown_ray()  # blocks the loop (bounded): nothing else runs now
    tracing.shutdown()  # send the spans still buffered
    log.info("stopped")
