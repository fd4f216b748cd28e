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
