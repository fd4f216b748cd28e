"""bench.router_load end to end at a tiny size: every request completes, over two client
processes, and the result says what a user of the router would see."""

from __future__ import annotations

import json
from pathlib import Path

from bench.router_load import main


def test_router_load_completes_every_request_and_reports_latencies(tmp_path: Path) -> None:
    out = tmp_path / "router_load.json"
    argv = ["--concurrency", "4", "--requests", "8", "--prompt-len", "16", "--output-len", "6"]
    argv += ["--stream-intervals", "auto", "--client-processes", "2"]
    assert main([*argv, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["client_processes"] == 2
    (run,) = result["runs"]
    assert run["ok"] == 8
    assert run["tok_s"] > 0
    # Six tokens a request, at 4 streams one token a message unless the stream fell
    # behind (then several go together): never more messages than tokens.
    assert 1 < run["messages_per_request"] <= 6
    assert run["tpot_ms_p50"] > 0 and run["message_gap_ms_p99"] >= run["message_gap_ms_p50"]


def test_router_load_measures_each_tier_size_against_one_process(tmp_path: Path) -> None:
    out = tmp_path / "router_tier.json"
    argv = ["--concurrency", "4", "--requests", "8", "--prompt-len", "16", "--output-len", "6"]
    argv += ["--router-processes", "1,2", "--out", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["router_processes"] == [1, 2]
    one, two = result["runs"]
    assert (one["router_processes"], two["router_processes"]) == (1, 2)
    assert one["ratio"] == 1.0 and two["ratio"] == round(two["tok_s"] / one["tok_s"], 2)
    assert one["ok"] == two["ok"] == 8
    # Every request was served by one of the processes, and each counted its own.
    assert sum(one["requests_per_router"]) == sum(two["requests_per_router"]) == 8
    assert len(two["requests_per_router"]) == 2
