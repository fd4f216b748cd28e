"""The service's whole configuration, as `pdserve serve` builds it from its flags: the
cluster and its pools, the serving core, the gRPC edge, metrics, the admin API, the
planner and the router tier. Every router process of a tier gets the same one."""

from __future__ import annotations

from dataclasses import dataclass, field

from router.edge.security import EdgeSecurity
from router.fleet.cluster_config import ClusterConfig
from router.observability.metrics import DEFAULT_METRICS_PORT
from router.planner.config import PlannerConfig
from router.serving.config import RouterConfig


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
    # Router processes serving the port (router/tier/): this one owns the fleet, the
    # others route over it. 1: no tier.
    router_processes: int = 1
    # With a tier: how long a decode worker keeps the requests of a router process that
    # went away, for a resumed stream to take over, before it aborts them.
    resume_grace_s: float = 30.0
