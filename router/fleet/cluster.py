"""Ray plumbing for one deployment: start or join Ray, host the KV rendezvous store,
create a worker actor in a placement group of its own, and tear it down.

What to run where (how many workers, restarts, scaling, pairing) lives in
`router.fleet.pools`; this module only knows how to make and remove one worker.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import secrets
import socket
import tempfile
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from torch.distributed import TCPStore

from decode_worker.colocated import ColocatedWorker
from decode_worker.worker import DecodeWorker
from engine.core.role import EngineRole
from engine.log_setup import LOG_LEVEL_ENV, current_level
from engine.parallel.tp_follower import TPFollower
from engine.wire import POOLS, CallSpec, TPGroupSpec, WorkerInfo  # noqa: F401 - the pools, named once
from engine.worker.calls import TOKEN_BYTES
from prefill_worker.worker import PrefillWorker
from router.fleet.clients import DirectWorkerClient, WorkerClient
from router.fleet.cluster_config import ClusterConfig
from router.fleet.daemon_calls import call_in_daemon_thread
from router.fleet.local_ray import STOP_RAY_S, LocalRay

log = logging.getLogger(__name__)

_ROLES: dict[str, EngineRole] = {
    "prefill": EngineRole.PREFILL,
    "decode": EngineRole.DECODE,
    "colocated": EngineRole.COLOCATED,
}
_CLASSES: dict[str, type] = {
    "prefill": PrefillWorker,
    "decode": DecodeWorker,
    "colocated": ColocatedWorker,
}


class StartupError(RuntimeError):
    """A worker failed to start; the message names the worker and its error."""


@dataclass
class SpawnedWorker:
    handle: Any
    info: WorkerInfo
    pg: PlacementGroup | None  # None: no placement group of its own to give back
    # Its verbs over its call connection; None: as Ray actor calls on `handle`.
    client: WorkerClient | None = None
    # A tensor-parallel worker's other ranks (engine.parallel.tp_follower), held here: Ray ends
    # an actor once no handle to it is left.
    followers: tuple[Any, ...] = ()


class WorkerSpawner(Protocol):
    """What the pools need of a cluster (`Cluster`; tests give a fake): its config, the
    KV rendezvous store's address, and workers made and removed."""

    @property
    def config(self) -> ClusterConfig: ...
    @property
    def store_host(self) -> str: ...
    @property
    def store_port(self) -> int: ...
    @property
    def use_gpus(self) -> bool: ...
    @property
    def abandoned(self) -> bool: ...  # Ray is going down with the service: no more calls
    def start_store(self) -> None: ...
    async def spawn(self, pool: str, index: int) -> SpawnedWorker: ...
    def remove(self, handle: Any, pg: PlacementGroup | None) -> None: ...


class Cluster:
    """Ray and the rendezvous store of one deployment; makes and removes workers."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.abandoned = False  # see abandon_ray()
        self._store: TCPStore | None = None
        self._local_ray: LocalRay | None = None
        self.store_host = "127.0.0.1"
        self._use_gpus: bool | None = config.use_gpus
        # What the workers' call connections authenticate the router by (engine/worker/calls.py).
        self._call_token = secrets.token_bytes(TOKEN_BYTES)

    @property
    def call_token(self) -> bytes:
        """The secret the workers' call connections take (a router tier's other
        processes call the workers with it too)."""
        return self._call_token

    async def start_ray(self) -> None:
        """Join the cluster at `ray_address`, or start a local Ray instance in a session
        of its own (router/fleet/local_ray.py) and join that. The driver connects on a thread,
        so the event loop (the gRPC server, answering NOT_SERVING) keeps running; stop
        with `shutdown_ray()` on the main thread."""
        if ray.is_initialized():
            return
        if self.config.ray_address:
            address = self.config.ray_address
            await call_in_daemon_thread(lambda: _join_ray(address), "ray-join")
            self.store_host = ray.util.get_node_ip_address()
            return
        workers = max(sum(self.config.initial_sizes.values()), self.config.max_workers)
        # Every worker needs a CPU slot even on a 2-core machine; Ray's CPU count is a
        # scheduling token, the torch thread count is set per worker. Room is left for
        # scaling up and for replacements.
        self._local_ray = await LocalRay.start(max(os.cpu_count() or 1, 2 * workers + 4))
        gcs_address = self._local_ray.gcs_address
        try:
            await call_in_daemon_thread(lambda: _join_ray(gcs_address), "ray-join")
        except BaseException:
            # A join still under way would wait for the GCS stopped here: leave Ray be.
            self.abandon_ray()
            raise

    def start_store(self) -> None:
        """Host the rendezvous store the KV channels meet at, listening on this node's
        Ray address only (loopback for a local Ray), not on every interface."""
        if self._store is None:
            # torch's TCPStore binds every interface when it opens the port itself.
            listener = socket.create_server(
                (self.store_host, self.config.kv_store_port),
                family=socket.AF_INET6 if ":" in self.store_host else socket.AF_INET,
                backlog=128,
            )
            self._store = TCPStore(
                self.store_host,
                listener.getsockname()[1],
                is_master=True,
                wait_for_workers=False,
                timeout=timedelta(seconds=60),
                master_listen_fd=listener.fileno(),
            )
            listener.detach()  # the store owns the socket now, and closes it

    @property
    def store_port(self) -> int:
        assert self._store is not None, "store not started"
        return int(self._store.port)

    @property
    def use_gpus(self) -> bool:
        if self._use_gpus is None:
            self._use_gpus = ray.cluster_resources().get("GPU", 0) >= self.config.initial_gpus
        return self._use_gpus

    async def spawn(self, pool: str, index: int) -> SpawnedWorker:
        """Create one worker in its own placement group and start it: one actor, or for a
        tensor-parallel worker one actor per GPU (rank 0 the worker, the others
        engine.parallel.tp_follower), every bundle packed on one node."""
        if self.abandoned:  # a scale-up racing the service's going down with Ray
            raise StartupError(f"{pool}-{index} not started: Ray is going down")
        cfg = self.config
        args = cfg.args_for(pool)
        tp_size = args.tensor_parallel_size
        bundle = {"GPU": 1.0, "CPU": 1.0} if self.use_gpus else {"CPU": 1.0}
        extra = dict(cfg.pool_resources.get(pool, {}))
        pg = placement_group([{**bundle, **extra}] * tp_size, strategy="STRICT_PACK")
        try:
            await asyncio.wait_for(pg.ready(), cfg.placement_timeout_s)
        except TimeoutError as exc:
            remove_placement_group(pg)
            raise StartupError(
                f"could not place {pool} worker {index} with {tp_size} x "
                f"{ ({**bundle, **extra}) } on one node within "
                f"{cfg.placement_timeout_s:.0f}s; available: {ray.available_resources()}"
            ) from exc
        total = max(1, sum(cfg.initial_sizes.values()))
        threads = cfg.cpu_threads_per_worker or max(1, (os.cpu_count() or 1) // total)
        env = {"OMP_NUM_THREADS": str(threads), "PDSERVE_TORCH_THREADS": str(threads)}
        env[LOG_LEVEL_ENV] = current_level()  # the workers log at the router's --log-level
        # The OpenTelemetry SDK's own settings (batching, exporter headers, TLS) reach
        # the workers' exporters as they reach the router's.
        env |= {k: v for k, v in os.environ.items() if k.startswith("OTEL_")}
        if self._local_ray is not None:
            # A one-machine service's pair channels stay on loopback: gloo's sockets on
            # CPUs, NCCL's bootstrap on GPUs (unless the environment says otherwise).
            for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
                env[name] = os.environ.get(name, "lo")

        def actor_options(bundle_index: int) -> dict[str, Any]:
            return dict(
                num_cpus=bundle.get("CPU", 0),
                num_gpus=bundle.get("GPU", 0),
                resources=extra,
                max_restarts=0,  # the router replaces a dead worker itself, with a new epoch
                runtime_env={"env_vars": env},
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=bundle_index
                ),
            )

        group = new_tp_group(tp_size)
        handle: Any = (
            ray.remote(_CLASSES[pool])
            .options(**actor_options(0))  # type: ignore[attr-defined]
            .remote(args, index, cfg.tracing, group)
        )
        followers = [
            ray.remote(TPFollower)
            .options(**actor_options(rank))  # type: ignore[attr-defined]
            .remote(args, _ROLES[pool], group, rank)
            for rank in range(1, tp_size)
        ]
        try:
            calls = None
            if cfg.worker_calls == "direct":
                calls = CallSpec(self._call_token, str(ray.util.get_node_ip_address()))
            started = await asyncio.wait_for(
                asyncio.gather(handle.start.remote(calls), *(f.start.remote() for f in followers)),
                cfg.startup_timeout_s,
            )
            info = started[0]
            if followers:
                gpus = info.gpu_ids + tuple(g for ids in started[1:] for g in ids)
                info = dataclasses.replace(info, gpu_ids=gpus)
        except Exception as exc:
            self.remove(handle, pg)
            if isinstance(exc, TimeoutError):
                raise StartupError(
                    f"{pool} worker {index} did not start within {cfg.startup_timeout_s:.0f}s"
                ) from exc
            raise StartupError(f"{pool} worker {index} failed to start: {root_cause(exc)}") from exc
        client = None
        if info.call_address:
            client = DirectWorkerClient(info.call_address, self._call_token)
        return SpawnedWorker(handle, info, pg, client, tuple(followers))

    def remove(self, handle: Any, pg: PlacementGroup | None) -> None:
        """Kill a worker's actor and give back its placement group (idempotent); nothing
        once Ray is abandoned (it goes down with the service, and both are Ray calls)."""
        if self.abandoned:
            return
        try:
            ray.kill(handle, no_restart=True)
        except Exception as exc:  # noqa: BLE001 - already gone
            log.debug("kill: %s", exc)
        if pg is not None:
            try:
                remove_placement_group(pg)
            except Exception as exc:  # noqa: BLE001 - already removed
                log.debug("remove placement group: %s", exc)

    @property
    def local_ray(self) -> LocalRay | None:
        """The local Ray instance this cluster started, or None (a cluster joined)."""
        return self._local_ray

    def abandon_ray(self) -> None:
        """The local Ray instance is going down with the service: make no more Ray calls
        (each would wait out the GCS reconnect timeout, 60 s, then abort the process);
        `abandoned` tells the caller to exit without the driver's teardown."""
        self.abandoned = True

    def shutdown_ray(self) -> None:
        """Leave Ray, and stop the local instance if this cluster started it; bounded
        (router/fleet/local_ray.py). Call from the main thread."""
        self._store = None
        if ray.is_initialized() and not self.abandoned:
            ray.shutdown()
        if self._local_ray is not None:
            # One already going down is not waited for: the service is leaving.
            self._local_ray.stop(0.0 if self.abandoned else STOP_RAY_S)
            self._local_ray = None


def _join_ray(address: str) -> None:
    # On a thread Ray sets no SIGTERM handler of its own (and says so): the service's
    # handler, which drains, is the one wanted.
    logging.getLogger("ray._private.worker").addFilter(_NoSignalHandlerNote())
    ray.init(address=address, log_to_driver=True)


class _NoSignalHandlerNote(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "SIGTERM handler is not set" not in record.getMessage()


def new_tp_group(size: int) -> TPGroupSpec | None:
    """Fresh meeting points for the ranks of one tensor-parallel worker (None for one GPU):
    a rendezvous file in the node's temporary folder and an abstract Unix socket, both
    named by a random token, so a replacement never meets its predecessor's ranks."""
    if size == 1:
        return None
    token = secrets.token_hex(8)
    return TPGroupSpec(
        size=size,
        rendezvous_file=os.path.join(tempfile.gettempdir(), f"pdserve-tp-{token}"),
        step_address=f"\0pdserve-tp-{token}",
        authkey=secrets.token_bytes(32),
    )


def root_cause(exc: BaseException) -> str:
    cause: Any = getattr(exc, "cause", None) or exc
    return f"{type(cause).__name__}: {cause}"
