"""deploy/prometheus/: the alerting rules pass `promtool check rules` and their unit tests
(`promtool test rules`), every alert has a test where it fires, the example config is
valid, and the rules and the dashboard read only metrics the router exports."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine.wire import PhaseReport, PoolName, WorkerStats
from router.observability.fleet_metrics import FleetCollector, FleetState
from router.observability.metrics import RouterMetrics
from router.observability.phase_metrics import PhaseMetrics
from router.observability.serving_metrics import migrations_counter
from router.planner.metrics import planner_metrics
from router.serving.protocol import PoolStats
from tests.prometheus_server import DEPLOY, find_binary

REPO = Path(__file__).resolve().parents[1]
RULES = DEPLOY / "pdserve-rules.yml"
RULE_TESTS = DEPLOY / "pdserve-rules.test.yml"
PROMTOOL = find_binary("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool not installed (Debian package `prometheus`; .ci/run installs it)",
)


def promtool(*args: str, stdin: bytes | None = None) -> str:
    done = subprocess.run(
        [str(PROMTOOL), *args], cwd=DEPLOY, input=stdin, capture_output=True, timeout=60
    )
    output = (done.stdout + done.stderr).decode()
    assert done.returncode == 0, output
    return output


@needs_promtool
def test_rules_are_valid_and_pass_their_unit_tests() -> None:
    assert "SUCCESS: 7 rules found" in promtool("check", "rules", RULES.name)
    assert "SUCCESS" in promtool("test", "rules", RULE_TESTS.name)
    promtool("check", "config", "prometheus.yml")  # loads the rules it names too


def test_every_alert_has_a_test_where_it_fires() -> None:
    rules = yaml.safe_load(RULES.read_text())["groups"][0]["rules"]
    alerts = {rule["alert"] for rule in rules}
    for topic in ("NotServing", "PoolBelowSize", "KVCacheNearFull", "ErrorRate", "SLO"):
        assert any(topic in alert for alert in alerts), topic
    firing = {
        case["alertname"]
        for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]
        for case in test["alert_rule_test"]
        if case["exp_alerts"]
    }
    assert firing == alerts


def _exported_series() -> set[str]:
    """Every series name the router's /metrics can carry, from its real registries."""
    metrics = RouterMetrics()
    phases = PhaseMetrics(metrics.registry)
    planner_metrics(metrics.registry)  # with --planner
    migrations_counter(metrics.registry)  # the serving core registers it at start
    fleet = FleetCollector()
    metrics.registry.register(fleet)
    stats = WorkerStats(PoolName.DECODE, 0, 100, 25, 2, 1, 32, 64, 0)
    metrics.pools.set_source(lambda: PoolStats((stats,), 1, 0))
    fleet.set_source(lambda: FleetState(True, {"decode": 1}, {"decode": 1}))
    phases.observe(
        "decode",
        0,
        PhaseReport(
            queue_s=0.1,
            compute_s=0.2,
            transfer_s=0.3,
            kv_signal_s=0.05,
            wire_bytes=4096,
            wire_s=0.001,
            admission_s=0.4,
            first_step_s=0.5,
        ),
    )
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
    names = set()
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        # By type: a labelled family nobody has observed yet has no samples.
        names |= {family.name + suffix for suffix in suffixes.get(family.type, ("",))}
    return names


def _promql_names(expr: str) -> set[str]:
    return set(re.findall(r"\bpdserve_\w+", expr))


def test_rules_and_dashboard_query_only_exported_metrics() -> None:
    exported = _exported_series()
    rules = yaml.safe_load(RULES.read_text())["groups"][0]["rules"]
    dashboard = json.loads((REPO / "deploy" / "grafana" / "pdserve.json").read_text())
    queries = [rule["expr"] for rule in rules]
    queries += [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    for expr in queries:
        assert _promql_names(expr) <= exported, (expr, _promql_names(expr) - exported)


@needs_promtool
def test_the_full_exposition_passes_promtool_lint() -> None:
    metrics = RouterMetrics()
    PhaseMetrics(metrics.registry).observe("prefill", 0, PhaseReport(queue_s=0.1, compute_s=1))
    metrics.registry.register(FleetCollector())
    promtool("check", "metrics", stdin=generate_latest(metrics.registry))


def test_the_alerts_inputs_say_not_serving_until_told_and_count_each_pool() -> None:
    fleet = FleetCollector()

    def read() -> dict[tuple[str, str], float]:
        return {
            (sample.name, sample.labels.get("pool", "")): sample.value
            for family in fleet.collect()
            for sample in family.samples
        }

    before = read()  # a router whose pools are not up yet
    assert before[("pdserve_serving", "")] == 0
    assert before[("pdserve_pool_live_workers", "decode")] == 0
    fleet.set_source(lambda: FleetState(True, {"prefill": 1, "decode": 2}, {"decode": 1}))
    after = read()
    assert after[("pdserve_serving", "")] == 1
    assert after[("pdserve_pool_target_workers", "decode")] == 2
    assert after[("pdserve_pool_live_workers", "decode")] == 1  # PdservePoolBelowSize's case
    assert after[("pdserve_pool_live_workers", "prefill")] == 0
