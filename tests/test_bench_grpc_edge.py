"""bench.grpc_edge: both servers answer through their real gRPC stacks, and the client
splits each call's time around the server's clock readings."""

from __future__ import annotations

import json
from pathlib import Path

from bench import grpc_edge


def test_the_edge_benchmark_times_both_servers(tmp_path: Path) -> None:
    out = tmp_path / "edge.json"
    argv = ["--requests", "6", "--warmup", "2", "--rounds", "1", "--gap-ms", "1"]
    assert grpc_edge.main([*argv, "--work-ms", "30", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["provenance"]["command"].startswith("python -m bench.grpc_edge")
    for server in grpc_edge.SERVERS:
        r = record["results"][server]
        # The way in and the way out are each part of the edge, and none of the 30 ms
        # of work is: a split taken from the wrong readings would count it.
        assert 0 < r["in_ms_p50"] < r["edge_ms_p50"] < 30
        assert 0 < r["out_ms_p50"] < r["edge_ms_p50"]
