"""Start the worker pools as Ray actors in one placement group, pair them, and tear down.

Each worker gets one bundle ({"GPU": 1} on GPU machines, CPUs otherwise); the
placement group keeps a deployment's workers reserved together. Startup fails
with the failing worker's own error (bad model path, out of memory, layout
mismatch) instead of hanging.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from decode_worker.colocated import ColocatedWorker
from decode_worker.worker import DecodeWorker
from engine.factory import EngineArgs
from prefill_worker.worker import PrefillWorker
from router.orchestrator import WorkerRef

log = logging.getLogger(__name__)


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

    def __post_init__(self) -> None:
        if self.num_colocated_workers < 0:
            raise ValueError("num_colocated_workers must be >= 0")
        if self.num_colocated_workers == 0 and (
            self.num_prefill_workers < 1 or self.num_decode_workers < 1
        ):
            raise ValueError("need at least one prefill and one decode worker")
        for pool, resources in self.pool_resources.items():
            if pool not in ("prefill", "decode", "colocated"):
                raise ValueError(f"pool_resources: unknown pool {pool!r}")
            if any(amount < 0 for amount in resources.values()):
                raise ValueError(f"pool_resources[{pool!r}]: amounts must be >= 0")

    @property
    def roles(self) -> list[tuple[str, int]]:
        """(pool, index) of every worker, in rank order."""
        if self.num_colocated_workers:
            return [("colocated", i) for i in range(self.num_colocated_workers)]
        return [("prefill", i) for i in range(self.num_prefill_workers)] + [
            ("decode", i) for i in range(self.num_decode_workers)
        ]


class StartupError(RuntimeError):
    """A worker failed to start; the message names the worker and its error."""


class Cluster:
    """Owns the Ray actors of one deployment."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.prefill: list[WorkerRef] = []
        self.decode: list[WorkerRef] = []
        self.colocated: list[WorkerRef] = []
        self._pg: PlacementGroup | None = None
        self._started_ray = False

    @property
    def num_workers(self) -> int:
        return len(self.config.roles)

    @property
    def workers(self) -> list[WorkerRef]:
        return self.prefill + self.decode + self.colocated

    def init_ray(self) -> None:
        """Start or join Ray; call from the main thread (so is shutdown_ray)."""
        self._init_ray()

    def _init_ray(self) -> None:
        if ray.is_initialized():
            return
        if self.config.ray_address:
            ray.init(address=self.config.ray_address, log_to_driver=True)
        else:
            # Every worker needs a CPU slot even on a 2-core machine; Ray's CPU count
            # is a scheduling token, the torch thread count is set per worker.
            ray.init(
                num_cpus=max(os.cpu_count() or 1, self.num_workers + 1),
                include_dashboard=False,
                # With router.config.keep_ray_on_loopback() (the CLI calls it) Ray keeps
                # this; otherwise Ray swaps loopback for the host's address.
                _node_ip_address="127.0.0.1",
            )
            self._started_ray = True

    def start(self) -> None:
        """Create, start and pair every worker; raises StartupError on any failure."""
        self._init_ray()
        cfg = self.config
        use_gpus = cfg.use_gpus
        if use_gpus is None:
            use_gpus = ray.cluster_resources().get("GPU", 0) >= self.num_workers
        bundle = {"GPU": 1.0, "CPU": 1.0} if use_gpus else {"CPU": 1.0}
        bundles = [{**bundle, **cfg.pool_resources.get(pool, {})} for pool, _ in cfg.roles]
        self._pg = placement_group(bundles, strategy="PACK")
        try:
            ray.get(self._pg.ready(), timeout=cfg.placement_timeout_s)
        except ray.exceptions.GetTimeoutError as exc:
            available = ray.available_resources()
            self.stop(shutdown_ray=False)
            raise StartupError(
                f"could not place {self.num_workers} workers as {bundles} within "
                f"{cfg.placement_timeout_s:.0f}s; available: {available}"
            ) from exc
        threads = cfg.cpu_threads_per_worker or max(1, (os.cpu_count() or 1) // self.num_workers)
        env = {"OMP_NUM_THREADS": str(threads), "PDSERVE_TORCH_THREADS": str(threads)}
        classes = {"prefill": PrefillWorker, "decode": DecodeWorker, "colocated": ColocatedWorker}
        roles: list[tuple[str, type, EngineArgs, int]] = [
            (pool, classes[pool], cfg.prefill_args if pool == "prefill" else cfg.decode_args, idx)
            for pool, idx in cfg.roles
        ]
        handles = []
        for bundle_idx, (pool, cls, args, idx) in enumerate(roles):
            actor_cls = ray.remote(cls)
            handle = actor_cls.options(  # type: ignore[attr-defined]
                name=None,
                num_cpus=bundle.get("CPU", 0),
                num_gpus=bundle.get("GPU", 0),
                resources=dict(cfg.pool_resources.get(pool, {})),
                max_restarts=0,
                runtime_env={"env_vars": env},
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._pg, placement_group_bundle_index=bundle_idx
                ),
            ).remote(args, idx)
            handles.append(handle)
        # Rank 0 hosts the rendezvous store, on a port free on its own host.
        host, port = ray.get(
            handles[0].rendezvous_address.remote(self._started_ray), timeout=cfg.startup_timeout_s
        )
        init_method = f"tcp://{host}:{port}"
        # Colocated replicas exchange no KV: each is a process group of one (none needed).
        world = 1 if cfg.num_colocated_workers else len(handles)
        starts = [
            h.start.remote(0 if world == 1 else rank, world, init_method)
            for rank, h in enumerate(handles)
        ]
        role_of = {ref: roles[i] for i, ref in enumerate(starts)}
        pending = list(starts)
        while pending:
            # Surface the first failure at once: the others would wait for it at the rendezvous.
            done, pending = ray.wait(pending, num_returns=1, timeout=cfg.startup_timeout_s)
            if not done:
                self._kill(handles)
                raise StartupError(f"workers did not start within {cfg.startup_timeout_s:.0f}s")
            try:
                ray.get(done[0])
            except Exception as exc:  # noqa: BLE001 - re-raised with the worker named
                role, _, _, idx = role_of[done[0]]
                self._kill(handles)
                raise StartupError(
                    f"{role} worker {idx} failed to start: {_root_cause(exc)}"
                ) from exc
        infos = ray.get(starts)
        pools = {"prefill": self.prefill, "decode": self.decode, "colocated": self.colocated}
        for (role, _, _, idx), handle, info in zip(roles, handles, infos, strict=True):
            pools[role].append(WorkerRef(role, idx, handle, info))
        self._check_pairing()
        decode_by_rank = {w.info.rank: w.handle for w in self.decode}
        ray.get([w.handle.set_peers.remote(decode_by_rank) for w in self.prefill])
        log.info(
            "cluster ready: %d prefill + %d decode + %d colocated workers on %s",
            len(self.prefill),
            len(self.decode),
            len(self.colocated),
            "GPUs" if use_gpus else "CPUs",
        )

    def _check_pairing(self) -> None:
        first = self.workers[0]
        for ref in self.workers[1:]:
            problem = first.info.layout.mismatch(ref.info.layout)
            if problem is not None:
                message = (
                    f"KV layout mismatch between {first.pool} worker {first.index} and "
                    f"{ref.pool} worker {ref.index}: {problem}"
                )
                self.stop(shutdown_ray=False)
                raise StartupError(message)

    def _kill(self, handles: list[Any]) -> None:
        for handle in handles:
            ray.kill(handle, no_restart=True)
        self.prefill, self.decode, self.colocated = [], [], []
        self.stop(shutdown_ray=False)

    def stop(self, shutdown_ray: bool = True) -> None:
        """Shut the workers down and release the placement group (idempotent)."""
        refs = self.workers
        if refs:
            try:
                ray.get([w.handle.shutdown.remote() for w in refs], timeout=30)
            except Exception as exc:  # noqa: BLE001 - best effort on the way out
                log.warning("worker shutdown: %s", exc)
        for ref in refs:
            ray.kill(ref.handle, no_restart=True)
        self.prefill, self.decode, self.colocated = [], [], []
        if self._pg is not None:
            remove_placement_group(self._pg)
            self._pg = None
        if shutdown_ray:
            self.shutdown_ray()

    def shutdown_ray(self) -> None:
        """Stop the local Ray instance if this cluster started it."""
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False


def _root_cause(exc: BaseException) -> str:
    cause: Any = getattr(exc, "cause", None) or exc
    return f"{type(cause).__name__}: {cause}"
