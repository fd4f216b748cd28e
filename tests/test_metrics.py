"""/metrics: names, types and labels, and counters that match the calls a client made.

A real grpc.aio server with a scripted core and the metrics HTTP endpoint on loopback;
the end-to-end service's worker gauges are checked in test_service_e2e.py.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest

from bench.harness import REPO, free_port
from bench.harness.metrics import scrape, value
from engine.wire import PoolName, WorkerStats
from router.cli.client import ClientSecurity, stream_generate
from router.edge.grpc_server import GrpcServer
from router.edge.security import EdgeSecurity
from router.observability import metrics as router_metrics
from router.observability.metrics import RouterMetrics
from router.serving.protocol import PoolStats
from tests.fake_core import FakeCore

HISTOGRAMS = (
    "pdserve_time_to_first_token_seconds",
    "pdserve_inter_token_latency_seconds",
    "pdserve_e2e_request_latency_seconds",
    "pdserve_request_queue_time_seconds",
    "pdserve_request_prefill_time_seconds",
    "pdserve_kv_transfer_seconds",
    "pdserve_request_prompt_tokens",
    "pdserve_request_generation_tokens",
)
COUNTERS = {
    "pdserve_requests": {"finish_reason"},
    "pdserve_request_errors": {"code"},
    "pdserve_prompt_tokens": set(),
    "pdserve_generation_tokens": set(),
    "pdserve_prefix_cache_queries": {"pool"},
    "pdserve_prefix_cache_hits": {"pool"},
    "pdserve_kv_transfer_bytes": set(),
    "pdserve_kv_transfer_failures": set(),
    "pdserve_preemptions": {"pool"},
    "pdserve_worker_restarts": {"pool"},
    "pdserve_spec_decode_draft_tokens": {"pool"},
    "pdserve_spec_decode_accepted_tokens": {"pool"},
}
GAUGES = {
    "pdserve_num_requests_running": {"pool", "worker"},
    "pdserve_num_requests_waiting": {"pool", "worker"},
    "pdserve_kv_cache_usage_ratio": {"pool", "worker"},
    "pdserve_router_in_flight": set(),
    "pdserve_router_queued": set(),
}
# With --planner (router/planner/metrics.py, registered on the same registry).
PLANNER_SERIES = {
    "pdserve_planner_decisions_total",
    "pdserve_planner_target_workers",
    "pdserve_planner_load_workers",
}
# Registered by the serving core (router/serving/run/migrations.py) on the same registry.
MIGRATION_SERIES = {"pdserve_request_migrations_total"}

# Requests moved off lost or drained workers (router/serving/run/migrations.py, same registry).
MIGRATION_SERIES = {"pdserve_request_migrations_total"}

PHASE_AND_FLEET_SERIES = {
    f"pdserve_phase_{phase}_seconds_{part}"
    for phase in (
        "queue",
        "prefill",
        "kv_transfer",
        "kv_signal",
        "decode_admission",
        "first_decode_step",
    )
    for part in ("bucket", "sum", "count")
} | {
    "pdserve_kv_wire_bytes_total",
    "pdserve_kv_wire_seconds_total",
    "pdserve_serving",
    "pdserve_pool_live_workers",
    "pdserve_pool_target_workers",
}


def worker(pool: str, index: int, **kw: Any) -> WorkerStats:
    base = WorkerStats(PoolName(pool), index, 100, 25, 2, 1, 32, 64, 0)
    return replace(base, **kw)


def test_metrics_count_what_clients_sent(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("tok\n")
    metrics = RouterMetrics()
    decode = worker("decode", 0, num_preemptions=3, spec_draft_tokens=40, spec_accepted_tokens=25)
    stats = [PoolStats((worker("prefill", 0), decode), 1, 2)]
    metrics.pools.set_source(lambda: stats[0])
    port = free_port()
    stop_http = metrics.serve("127.0.0.1", port)
    core = FakeCore(num_chunks=3)
    good = ClientSecurity(token="tok")

    async def main() -> None:
        server = GrpcServer(
            core,
            host="127.0.0.1",
            port=0,
            security=EdgeSecurity(auth_token_file=str(tokens)),
            metrics=metrics,
        )
        await server.start()
        await server.set_serving()
        try:
            for _ in range(4):
                async for _ in stream_generate(server.address, prompt="p", security=good):
                    pass
            bad_calls: list[tuple[ClientSecurity, dict[str, Any]]] = [
                (good, {}),  # no prompt
                (ClientSecurity(), {"prompt": "p"}),  # no token
            ]
            for security, kwargs in bad_calls:
                with pytest.raises(grpc.aio.AioRpcError):
                    async for _ in stream_generate(server.address, security=security, **kwargs):
                        pass
            # Over the 4 MiB message limit: refused before the handler, and still counted.
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                huge = "x" * 5_000_000
                async for _ in stream_generate(server.address, prompt=huge, security=good):
                    pass
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        finally:
            await server.stop(0)

    try:
        asyncio.run(main())
        types, samples, labels = scrape(port)
        for name in HISTOGRAMS:
            assert types.get(name) == "histogram", name
        for name, names in COUNTERS.items():
            assert types.get(name) == "counter", name
            assert labels[name] <= names, (name, labels[name])
        for name, names in GAUGES.items():
            assert types.get(name) == "gauge", name
            assert labels[name] == names, (name, labels[name])

        # 4 requests of 3 tokens in 3 chunks (prompt of 2 tokens), 3 refused calls.
        assert value(samples, "pdserve_requests_total", finish_reason="length") == 4
        assert value(samples, "pdserve_requests_total", finish_reason="stop") == 0
        assert value(samples, "pdserve_request_errors_total", code="INVALID_ARGUMENT") == 1
        assert value(samples, "pdserve_request_errors_total", code="UNAUTHENTICATED") == 1
        assert value(samples, "pdserve_request_errors_total", code="RESOURCE_EXHAUSTED") == 1
        assert value(samples, "pdserve_prompt_tokens_total") == 8
        assert value(samples, "pdserve_generation_tokens_total") == 12
        assert value(samples, "pdserve_time_to_first_token_seconds_count") == 4
        assert value(samples, "pdserve_inter_token_latency_seconds_count") == 8
        assert value(samples, "pdserve_e2e_request_latency_seconds_count") == 4
        assert value(samples, "pdserve_request_generation_tokens_sum") == 12

        # Worker numbers, through pool_stats.
        assert value(samples, "pdserve_num_requests_running", pool="decode", worker="0") == 2
        assert value(samples, "pdserve_num_requests_waiting", pool="prefill", worker="0") == 1
        assert value(samples, "pdserve_kv_cache_usage_ratio", pool="decode", worker="0") == 0.25
        assert value(samples, "pdserve_router_in_flight") == 1
        assert value(samples, "pdserve_router_queued") == 2
        assert value(samples, "pdserve_prefix_cache_hits_total", pool="prefill") == 32
        assert value(samples, "pdserve_prefix_cache_queries_total", pool="decode") == 64
        assert value(samples, "pdserve_preemptions_total", pool="decode") == 3
        assert value(samples, "pdserve_spec_decode_draft_tokens_total", pool="decode") == 40
        assert value(samples, "pdserve_spec_decode_accepted_tokens_total", pool="decode") == 25

        # A restarted worker counts from zero again; the pool's counter does not go back.
        stats[0] = PoolStats(
            (worker("prefill", 0, prefix_hit_tokens=40), worker("decode", 0, num_preemptions=1)),
            0,
            0,
        )
        _, samples, _ = scrape(port)
        assert value(samples, "pdserve_prefix_cache_hits_total", pool="prefill") == 40
        assert value(samples, "pdserve_preemptions_total", pool="decode") == 4

        # No pools yet (warming up) or a failing read: the scrape still works.
        def broken() -> PoolStats:
            raise RuntimeError("pools are still starting")

        metrics.pools.set_source(broken)
        types, samples, _ = scrape(port)
        assert value(samples, "pdserve_router_in_flight") == 0
        assert ("pdserve_num_requests_running", frozenset()) not in samples
        assert value(samples, "pdserve_preemptions_total", pool="decode") == 4
    finally:
        stop_http()


def test_router_events_reach_the_process_metrics() -> None:
    registry = router_metrics.get_metrics().registry

    def read(name: str, **labels: str) -> float:
        return registry.get_sample_value(name, labels) or 0.0

    before = (
        read("pdserve_kv_transfer_bytes_total"),
        read("pdserve_kv_transfer_failures_total"),
        read("pdserve_worker_restarts_total", pool="decode"),
    )
    router_metrics.observe_kv_transfer(4096)
    router_metrics.kv_transfer_failed()
    router_metrics.worker_restarted("decode")
    assert read("pdserve_kv_transfer_bytes_total") == before[0] + 4096
    assert read("pdserve_kv_transfer_failures_total") == before[1] + 1
    assert read("pdserve_worker_restarts_total", pool="decode") == before[2] + 1


def test_metrics_port_in_use_fails_loudly() -> None:
    port = free_port()
    stop = RouterMetrics().serve("127.0.0.1", port)
    try:
        with pytest.raises(OSError, match="metrics"):
            RouterMetrics().serve("127.0.0.1", port)
    finally:
        stop()


def test_grafana_dashboard_queries_only_existing_metrics() -> None:
    dashboard = json.loads((REPO / "deploy" / "grafana" / "pdserve.json").read_text())
    exposed = set()
    for name in HISTOGRAMS:
        exposed |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    exposed |= {f"{name}_total" for name in COUNTERS} | set(GAUGES) | PLANNER_SERIES
    # router/observability/phase_metrics.py, router/observability/fleet_metrics.py
    exposed |= PHASE_AND_FLEET_SERIES
    exposed |= MIGRATION_SERIES
    titles = []
    for panel in dashboard["panels"]:
        titles.append(panel["title"].lower())
        for target in panel["targets"]:
            names = set(re.findall(r"\bpdserve_\w+", target["expr"]))
            assert names and names <= exposed, (panel["title"], names - exposed)
    for topic in ("first token", "inter-token", "end-to-end", "throughput", "kv cache usage"):
        assert any(topic in t for t in titles), topic
    for topic in ("queues", "bandwidth", "errors"):
        assert any(topic in t for t in titles), topic


def test_a_message_of_several_tokens_counts_each_gap_in_the_itl_histogram() -> None:
    """One update for N equal gaps leaves the histogram as N observations would."""
    from prometheus_client import CollectorRegistry, Histogram

    from router.observability.metrics_edge import observe_repeated

    registry = CollectorRegistry()
    buckets = (0.001, 0.01, 0.1)
    one_by_one = Histogram("one", "", buckets=buckets, registry=registry)
    repeated = Histogram("many", "", buckets=buckets, registry=registry)
    for gap, count in ((0.0005, 3), (0.01, 2), (0.05, 4), (2.0, 1), (0.02, 0)):
        for _ in range(count):
            one_by_one.observe(gap)
        observe_repeated(repeated, gap, count)

    def series(name: str) -> dict[str, float]:
        return {
            s.name.removeprefix(name) + str(s.labels.get("le", "")): s.value
            for metric in registry.collect()
            if metric.name == name
            for s in metric.samples
            if not s.name.endswith("_created")
        }

    assert series("many") == series("one")
    assert series("many")["_count"] == 10


def test_each_live_workers_tensor_parallel_size_is_a_gauge() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from router.observability.fleet_metrics import FleetCollector, FleetState

    collector = FleetCollector()
    registry = CollectorRegistry()
    registry.register(collector)
    collector.set_source(
        lambda: FleetState(
            serving=True, tensor_parallel={"prefill-0": ("prefill", 2), "decode-0": ("decode", 1)}
        )
    )
    text = generate_latest(registry).decode()
    assert 'pdserve_worker_tensor_parallel_size{pool="prefill",worker="prefill-0"} 2.0' in text
    assert 'pdserve_worker_tensor_parallel_size{pool="decode",worker="decode-0"} 1.0' in text
