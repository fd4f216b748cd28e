"""The main job: start the pools, serve gRPC, drain on SIGTERM, stop the pools."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from engine import tracing
from engine.core.outputs import FinalResult, TextChunk
from engine.model.model_loader import has_tokenizer, load_tokenizer
from router import port_holds
from router.admin import AdminServicer
from router.cluster import Cluster, ClusterConfig
from router.config import RouterConfig
from router.errors import NotReadyError
from router.fleet_metrics import FleetState, get_fleet_metrics
from router.grpc_server import GrpcServer, serve
from router.local_watch import watch_children
from router.metrics import DEFAULT_METRICS_PORT, get_metrics
from router.orchestrator import DisaggregatedGenerator
from router.phase_metrics import get_phase_metrics
from router.planner.config import PlannerConfig
from router.planner.loop import PlannerLoop
from router.planner.metrics import planner_metrics
from router.pools import Pools
from router.protocol import GenerateCall, PoolStats, ServerInfo
from router.security import EdgeSecurity

log = logging.getLogger("pdserve")
# Workers stop in well under a second when asked; a shutdown that takes longer is one
# whose Ray went down with the process group's signal.
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


@dataclass(frozen=True)
class ServeConfig:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    host: str = "127.0.0.1"
    port: int = 50051
    drain_grace_s: float = 30.0
    security: EdgeSecurity = field(default_factory=EdgeSecurity)
    metrics_host: str = "127.0.0.1"
    metrics_port: int = DEFAULT_METRICS_PORT  # 0 = no metrics endpoint
    enable_admin: bool = False  # AdminService (scale, drain); refused when off
    planner: PlannerConfig | None = None  # None: the pools keep the sizes they are given


async def run_service(
    config: ServeConfig,
    cluster: Cluster,
    on_started: Callable[[GrpcServer], None] | None = None,
) -> None:
    """Serve until SIGTERM/SIGINT, then drain in-flight requests and stop the workers.

    The caller owns Ray: `cluster.init_ray()` before and `cluster.shutdown_ray()` after,
    on the main thread (Ray's driver aborts at exit when torn down from a worker thread).
    """
    front = WarmingGenerator()
    loop = asyncio.get_running_loop()
    pools = Pools(cluster)
    planner: PlannerLoop | None = None
    metrics = get_metrics()
    get_phase_metrics()  # their families are on /metrics from the first scrape
    tracing.configure(config.cluster.tracing, "pdserve-router")
    servers: list[GrpcServer] = []
    stop_metrics = None
    if config.metrics_port:
        port_holds.release(config.metrics_host, config.metrics_port)  # held since before Ray
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
            return FleetState(
                serving=bool(servers) and servers[0].is_serving,
                target_workers=dict(pools.targets),
                live_workers={pool: len(pools.routable(pool)) for pool in pools.targets},
            )

        get_fleet_metrics().set_source(read_fleet)

    def started(server: GrpcServer) -> None:
        servers.append(server)
        if on_started is not None:
            on_started(server)

    async def warm_up() -> None:
        await pools.start()
        model_path = config.cluster.decode_args.resolve_model_path()
        tokenizer = None
        if has_tokenizer(model_path):
            tokenizer = await loop.run_in_executor(None, load_tokenizer, str(model_path))
        core = DisaggregatedGenerator(pools, tokenizer, config.router)
        core.start()
        front.inner = core
        if config.planner is not None:
            nonlocal planner
            planner = PlannerLoop(
                config.planner,
                pools,
                core,
                max_num_seqs=config.cluster.decode_args.scheduler.max_num_seqs,
                metrics=planner_metrics(metrics.registry),
            )
            planner.start()
        log.info("pools warm; SERVING")

    watcher: asyncio.Task[None] | None = None

    def ray_going_down(why: str) -> None:
        log.warning("%s; ending the streams in flight now", why)
        for server in servers:
            server.stop_now(f"the workers went down with the service ({why})")

    def on_drain() -> None:
        # The service is going away: a request whose worker is lost ends now (ABORT)
        # rather than moving. A local Ray that a process-group signal takes down with
        # the router can no longer be asked anything: its processes are watched instead.
        nonlocal watcher
        if front.inner is not None:
            front.inner.begin_shutdown()
        if cluster.started_local_ray:
            watcher = asyncio.ensure_future(watch_children(ray_going_down))

    try:
        await serve(
            front,
            config.host,
            config.port,
            drain_grace_s=config.drain_grace_s,
            warm_up=warm_up(),
            on_started=started,
            security=config.security,
            metrics=metrics,
            admin=AdminServicer(
                lambda: pools if front.inner is not None else None,
                config.enable_admin,
                lambda: front.inner,
                lambda: planner,
            ),
            on_drain=on_drain,
        )
    finally:
        if watcher is not None:
            watcher.cancel()
        metrics.pools.set_source(None)
        get_fleet_metrics().set_source(None)
        if stop_metrics is not None:
            stop_metrics()
        if planner is not None:
            await planner.stop()
        if front.inner is not None:
            await front.inner.stop()
        if not await pools.stop(timeout_s=STOP_WORKERS_S) and cluster.started_local_ray:
            # The signal went to the whole process group: the local Ray is going down.
            cluster.abandon_ray()
        tracing.shutdown()  # send the spans still buffered
        log.info("stopped")
