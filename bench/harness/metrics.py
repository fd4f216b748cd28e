"""A service's Prometheus endpoint, read as a client (or Prometheus) reads it."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
Scrape = tuple[dict[str, str], Samples, dict[str, set[str]]]


def scrape(port: int, host: str = "127.0.0.1") -> Scrape:
    """GET /metrics: (family -> type, (sample, labels) -> value, family -> label names)."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    types: dict[str, str] = {}
    samples: Samples = {}
    labels: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        labels[family.name] = set()
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
            labels[family.name] |= set(s.labels) - {"le"}
    return types, samples, labels


def value(samples: Samples, name: str, **labels: str) -> float:
    """One sample's value; 0 when absent (a counter nobody incremented yet)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


# The workers' phases (router/observability/phase_metrics.py) by the name the report gives them.
PHASES = {
    "queue": "pdserve_phase_queue_seconds",
    "compute": "pdserve_phase_prefill_seconds",
    "kv_transfer": "pdserve_phase_kv_transfer_seconds",
    "kv_signal": "pdserve_phase_kv_signal_seconds",
    "decode_admission": "pdserve_phase_decode_admission_seconds",
    "first_decode_step": "pdserve_phase_first_decode_step_seconds",
}


def phase_means_ms(before: Samples, after: Samples) -> dict[str, float]:
    """Each pool's mean phase times (ms) over the requests between two scrapes, keyed
    "<pool>.<phase>" (every worker of a pool together): where a request's time went."""
    totals: dict[str, list[float]] = {}
    for (name, labels), count in after.items():
        for phase, family in PHASES.items():
            if name != f"{family}_count":
                continue
            pool = dict(labels).get("pool", "")
            n = count - before.get((name, labels), 0.0)
            total = after.get((f"{family}_sum", labels), 0.0)
            total -= before.get((f"{family}_sum", labels), 0.0)
            acc = totals.setdefault(f"{pool}.{phase}", [0.0, 0.0])
            acc[0] += total
            acc[1] += n
    return {key: round(1000 * s / n, 3) for key, (s, n) in sorted(totals.items()) if n > 0}


def prefill_paths(before: Samples, after: Samples) -> dict[str, int]:
    """How many requests between two scrapes took each prefill path, keyed "path/reason"
    (router's `pdserve_prefill_path_total`): how much of a load the decode workers
    prefilled themselves, and why."""
    counts: dict[str, int] = {}
    for (name, labels), count in after.items():
        if name != "pdserve_prefill_path_total":
            continue
        n = int(count - before.get((name, labels), 0.0))
        if n > 0:
            label = dict(labels)
            counts[f"{label.get('path', '')}/{label.get('reason', '')}"] = n
    return dict(sorted(counts.items()))
