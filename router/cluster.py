"""Ray plumbing for one deployment: start or join Ray, host the KV rendezvous store,
create a worker actor in a placement group of its own, and tear it down.

What to run where (how many workers, restarts, scaling, pairing) lives in
`router.pools`; this module only knows how to make and remove one worker.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import secrets
import tempfile
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from torch.distributed import TCPStore

from decode_worker.colocated import ColocatedWorker
from decode_worker.worker import DecodeWorker
from engine.calls import TOKEN_BYTES, CallSpec
from engine.factory import EngineArgs
from engine.tp_follower import TPFollower
from engine.tracing import TracingConfig
from engine.wire import POOLS, TPGroupSpec
from engine.worker import WorkerInfo
from prefill_worker.worker import PrefillWorker
from router.clients import DirectWorkerClient, WorkerClient

log = logging.getLogger(__name__)

_CLASSES: dict[str, type] = {
    "prefill": PrefillWorker,
    "decode": DecodeWorker,
    "colocated": ColocatedWorker,
}


@dataclass(frozen=True)
class ClusterConfig:
    num_prefill_workers: int = 1
    num_decode_workers: int = 1
    # > 0: replicas that run both phases (take decode_args); no prefill/decode pools.
    num_colocated_workers: int = 0
    prefill_args: EngineArgs = field(default_factory=EngineArgs)
    decode_args: EngineArgs = field(default_factory=EngineArgs)
    ray_address: str | None = None  # None = start a local Ray instance
    use_gpus: bool | None = None  # None = use GPUs when Ray reports any
    startup_timeout_s: float = 600.0  # model loading on a slow disk can take minutes
    placement_timeout_s: float = 60.0  # resources that are not there will not appear
    # CPU workers: torch threads each (0 = share this machine's cores evenly).
    cpu_threads_per_worker: int = 0
    # Extra Ray resources each worker of a pool requires, e.g. {"prefill": {"prefill_node": 1}}:
    # with node types that offer them, each pool lands on its own kind of node.
    pool_resources: dict[str, dict[str, float]] = field(default_factory=dict)
    kv_store_port: int = 0  # the KV channels' rendezvous on the router's host (0 = any free)
    restart_workers: bool = True  # replace a worker that dies
    # The most workers the pools may grow to (the planner's budget); 0: the initial sizes.
    max_workers: int = 0
    tracing: TracingConfig = field(default_factory=TracingConfig)  # workers' spans (off)
    # How the router calls a started worker: its own TCP connection, or Ray actor calls.
    worker_calls: Literal["direct", "ray"] = "direct"

    def __post_init__(self) -> None:
        if self.num_colocated_workers < 0:
            raise ValueError("num_colocated_workers must be >= 0")
        if self.num_colocated_workers == 0 and (
            self.num_prefill_workers < 1 or self.num_decode_workers < 1
        ):
            raise ValueError("need at least one prefill and one decode worker")
        for pool, resources in self.pool_resources.items():
            if pool not in POOLS:
                raise ValueError(f"pool_resources: unknown pool {pool!r}")
            if any(amount < 0 for amount in resources.values()):
                raise ValueError(f"pool_resources[{pool!r}]: amounts must be >= 0")
        if self.worker_calls not in ("direct", "ray"):
            raise ValueError("worker_calls must be 'direct' or 'ray'")

    @property
    def initial_sizes(self) -> dict[str, int]:
        if self.num_colocated_workers:
            return {"prefill": 0, "decode": 0, "colocated": self.num_colocated_workers}
        return {
            "prefill": self.num_prefill_workers,
            "decode": self.num_decode_workers,
            "colocated": 0,
        }

    @property
    def initial_gpus(self) -> int:
        """GPUs the initial pools take: each worker holds its tensor-parallel size."""
        return sum(
            size * self.args_for(pool).tensor_parallel_size
            for pool, size in self.initial_sizes.items()
        )

    def args_for(self, pool: str) -> EngineArgs:
        return self.prefill_args if pool == "prefill" else self.decode_args


class StartupError(RuntimeError):
    """A worker failed to start; the message names the worker and its error."""


@dataclass
class SpawnedWorker:
    handle: Any
    info: WorkerInfo
    pg: PlacementGroup
    # Its verbs over its call connection; None: as Ray actor calls on `handle`.
    client: WorkerClient | None = None
    # A tensor-parallel worker's other ranks (engine.tp_follower), held here: Ray ends
    # an actor once no handle to it is left.
    followers: tuple[Any, ...] = ()


class Cluster:
    """Ray and the rendezvous store of one deployment; makes and removes workers."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self._started_ray = False
        self.abandoned = False  # see abandon_ray()
        self._store: TCPStore | None = None
        self.store_host = "127.0.0.1"
        self._use_gpus: bool | None = config.use_gpus
        # What the workers' call connections authenticate the router by (engine/calls.py).
        self._call_token = secrets.token_bytes(TOKEN_BYTES)

    def init_ray(self) -> None:
        """Start or join Ray; call from the main thread (so is shutdown_ray)."""
        if ray.is_initialized():
            return
        if self.config.ray_address:
            ray.init(address=self.config.ray_address, log_to_driver=True)
            self.store_host = ray.util.get_node_ip_address()
        else:
            workers = max(sum(self.config.initial_sizes.values()), self.config.max_workers)
            # Every worker needs a CPU slot even on a 2-core machine; Ray's CPU count
            # is a scheduling token, the torch thread count is set per worker. Room is
            # left for scaling up and for replacements.
            ray.init(
                address="local",
                num_cpus=max(os.cpu_count() or 1, 2 * workers + 4),
                include_dashboard=False,
                # With router.config.keep_ray_on_loopback() (the CLI calls it) Ray keeps
                # this; otherwise Ray swaps loopback for the host's address.
                _node_ip_address="127.0.0.1",
            )
            self._started_ray = True

    def start_store(self) -> None:
        """Host the rendezvous store the KV channels meet at."""
        if self._store is None:
            self._store = TCPStore(
                self.store_host,
                self.config.kv_store_port,
                is_master=True,
                wait_for_workers=False,
                timeout=timedelta(seconds=60),
            )

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
        engine.tp_follower), every bundle packed on one node."""
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
        # The OpenTelemetry SDK's own settings (batching, exporter headers, TLS) reach
        # the workers' exporters as they reach the router's.
        env |= {k: v for k, v in os.environ.items() if k.startswith("OTEL_")}

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
            .remote(args, _CLASSES[pool].role, group, rank)
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
        """Kill a worker's actor and give back its placement group (idempotent)."""
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
    def started_local_ray(self) -> bool:
        return self._started_ray

    def abandon_ray(self) -> None:
        """The local Ray instance died with this process group's signal: make no more Ray
        calls (each would wait out the GCS reconnect timeout, 60 s, then abort the
        process); `abandoned` tells the caller to exit without Ray's teardown."""
        self._started_ray = False
        self.abandoned = True

    def shutdown_ray(self) -> None:
        """Stop the local Ray instance if this cluster started it."""
        self._store = None
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False


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
