"""What tracing costs: the same `bench.load` workload against two 1P1D services running
side by side, one without tracing and one tracing every request (sample ratio 1) to an
OTLP receiver in this process. Both loads run at the same time, so whatever else the
machine does at any moment falls on both alike, and the two services compete for its
cores on equal terms: a service that spends more CPU per token falls behind.

Each round draws fresh prompts (its own seed) and sends the same ones to both services.
Besides latency and throughput, which a busy machine blurs, it counts the CPU time the
service's own processes (the router and its worker actors; not Ray's daemons, whose idle
time grows with a run's length) spent during the run, per output token (Linux: read
from /proc). First it measures the CPU time tracing adds per request in this process
(`bench.span_cost`). Prints one line per round and service, then the means; writes JSON.
Usage: python -m bench.tracing_cost [--rounds 4] [--concurrency 4] [--serve-args "..."]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import shlex
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.harness import ServiceProcess
from bench.harness.cpu import service_cpu_s
from bench.harness.otlp import OTLPSink
from bench.load import parse_args as load_args
from bench.load import run_load, summarize
from bench.report import provenance
from bench.span_cost import measure as measure_span_cost

MODES = ("off", "on")
FIGURES = (  # (label, summary key, sub-key): what the table compares
    ("out tok/s", "output_token_throughput", None),
    ("TTFT p50 ms", "ttft_ms", "p50"),
    ("TTFT p90 ms", "ttft_ms", "p90"),
    ("TPOT p50 ms", "tpot_ms", "p50"),
    ("ITL p90 ms", "itl_ms", "p90"),
    ("CPU ms/token", "cpu_ms_per_output_token", None),
)


def figure(summary: dict[str, Any], key: str, sub: str | None) -> float:
    value = summary[key] if sub is None else summary[key][sub]
    return float(value)


def run(services: dict[str, ServiceProcess], argv: list[str], seed: int) -> dict[str, Any]:
    """The same load against every service at once; each one's summary and CPU time."""
    args = {
        mode: load_args([*argv, "--seed", str(seed), "--target", svc.address])
        for mode, svc in services.items()
    }
    cpu_before = {mode: service_cpu_s(svc.proc.pid) for mode, svc in services.items()}

    async def loads() -> list[Any]:
        return await asyncio.gather(*(run_load(args[mode]) for mode in services))

    results = {}
    for mode, outcomes in zip(services, asyncio.run(loads()), strict=True):
        summary = summarize(outcomes, args[mode])
        summary["cpu_s"] = service_cpu_s(services[mode].proc.pid) - cpu_before[mode]
        tokens = max(1, summary["total_output_tokens"])
        summary["cpu_ms_per_output_token"] = 1000 * summary["cpu_s"] / tokens
        results[mode] = summary
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--prompt-len", default="32:256")
    p.add_argument("--output-len", default="16:64")
    p.add_argument("--seed", type=int, help="the first round's seed (default: a fresh one)")
    p.add_argument("--serve-args", default="", help="more `pdserve serve` flags for both")
    p.add_argument("--out", default="bench/results/tracing_cost.json")
    ns = p.parse_args()
    seed = secrets.randbelow(2**30) if ns.seed is None else ns.seed
    argv = [
        "--concurrency",
        str(ns.concurrency),
        "--num-requests",
        str(ns.num_requests),
        "--prompt-len",
        ns.prompt_len,
        "--output-len",
        ns.output_len,
        "--token-ids",
        "100:30000",
    ]
    kv = ["--prefill-kv-cache-gib", "0.25", "--decode-kv-cache-gib", "0.25"]
    kv += shlex.split(ns.serve_args)
    span_cost = measure_span_cost(400)
    print(
        f"CPU µs per request in-process: router {span_cost['router_off_us']:.0f} off, "
        f"{span_cost['router_on_us']:.0f} on; worker hooks {span_cost['worker_off_us']:.0f} "
        f"off, {span_cost['worker_on_us']:.0f} on",
        flush=True,
    )
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp, OTLPSink() as sink:
        services = {
            "off": ServiceProcess(kv, Path(tmp) / "off.log"),
            "on": ServiceProcess(
                [*kv, "--otlp-traces-endpoint", sink.endpoint], Path(tmp) / "on.log"
            ),
        }
        try:
            for svc in services.values():
                svc.wait_serving()
            run(services, [*argv, "--num-requests", "2"], seed + 10_000)  # warm-up prompts
            for r in range(ns.rounds):
                result = run(services, argv, seed + r)
                rounds.append({"seed": seed + r, **result})
                for mode in MODES:
                    values = "  ".join(
                        f"{label} {figure(result[mode], key, sub):8.1f}"
                        for label, key, sub in FIGURES
                    )
                    print(f"round {r} tracing {mode:<3}  {values}", flush=True)
        finally:
            for svc in services.values():
                svc.stop()
        num_traces = len({s.trace_id for s in sink.spans})
        num_spans = len(sink.spans)
    means = {
        mode: {
            label: statistics.mean(figure(rd[mode], key, sub) for rd in rounds)
            for label, key, sub in FIGURES
        }
        for mode in MODES
    }
    print(f"\nmeans over {ns.rounds} rounds ({ns.num_requests} requests each, c={ns.concurrency})")
    for label, _, _ in FIGURES:
        off, on = means["off"][label], means["on"][label]
        print(f"{label:<12} off {off:9.1f}   on {on:9.1f}   on/off {on / off:6.3f}")
    print(f"received {num_spans} spans in {num_traces} traces")
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(
        json.dumps(
            {
                "provenance": provenance("bench.tracing_cost", sys.argv[1:]),
                "params": {**vars(ns), "seed": seed},
                "rounds": rounds,
                "means": means,
                "span_cost": span_cost,
                "spans_received": num_spans,
                "traces_received": num_traces,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
