"""What an operator's alerts watch besides requests: is the router serving, and is
each pool at the size it was asked for (deploy/prometheus/ holds the rules).

Read at scrape time, on the metrics server's thread, from a source the service sets;
before it does (or when it returns None) the router counts as not serving.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.wire import POOLS


@dataclass(frozen=True)
class FleetState:
    serving: bool  # the health check answers SERVING
    target_workers: dict[str, int] = field(default_factory=dict)  # pool → asked-for size
    live_workers: dict[str, int] = field(default_factory=dict)  # pool → live and routable
    # worker id → (pool, its tensor-parallel size), for every live worker
    tensor_parallel: dict[str, tuple[str, int]] = field(default_factory=dict)


class FleetCollector(Collector):
    """`pdserve_serving` and each pool's target and live worker counts."""

    def __init__(self) -> None:
        self._source: Callable[[], FleetState | None] | None = None

    def set_source(self, source: Callable[[], FleetState | None] | None) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        state = self._source() if self._source is not None else None
        state = state or FleetState(serving=False)
        yield GaugeMetricFamily(
            "pdserve_serving",
            "1 while the router's health check answers SERVING (pools warm, not draining).",
            value=int(state.serving),
        )
        target = GaugeMetricFamily(
            "pdserve_pool_target_workers",
            "Workers a pool is meant to have (its size at start or after scaling).",
            labels=["pool"],
        )
        live = GaugeMetricFamily(
            "pdserve_pool_live_workers",
            "Workers of a pool that are live and take requests.",
            labels=["pool"],
        )
        for pool in POOLS:
            target.add_metric([pool], state.target_workers.get(pool, 0))
            live.add_metric([pool], state.live_workers.get(pool, 0))
        yield from (target, live)
        tp = GaugeMetricFamily(
            "pdserve_worker_tensor_parallel_size",
            "GPUs (processes) a live worker's model is split over.",
            labels=["pool", "worker"],
        )
        for worker_id, (worker_pool, size) in sorted(state.tensor_parallel.items()):
            tp.add_metric([worker_pool, worker_id], size)
        yield tp

    def describe(self) -> Iterator[Metric]:
        return iter(())  # keeps registration from calling the source


_default: FleetCollector | None = None
_lock = threading.Lock()


def get_fleet_metrics() -> FleetCollector:
    """This process's collector, on the router's registry (registered on first use)."""
    global _default
    with _lock:
        if _default is None:
            from router.observability.metrics import get_metrics

            _default = FleetCollector()
            get_metrics().registry.register(_default)
        return _default
