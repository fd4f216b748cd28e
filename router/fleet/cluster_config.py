"""What one deployment runs: pool sizes, each pool's engine, where Ray is, how workers are
placed and called (no Ray or torch imports: the CLI builds it before the server starts)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from engine.args import EngineArgs
from engine.tracing import TracingConfig
from engine.wire import POOLS


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
