"""Where one request's time to first token goes, read from its trace (concurrency 1).

    python -m bench.ttft_trace --out ttft_trace.json                  # CPU, embedded model
    python -m bench.ttft_trace --system colocated --prompt-tokens 512 --vocab-size 128256 \\
        --serve-args "--model deploy/model_configs/llama-3.2-1b --load-format dummy"   # GPU
    python -m bench.ttft_trace --load-concurrency 128 --load-requests 256   # before and after

Starts `pdserve serve` (`--system 1p1d`: one prefill and one decode worker, every prompt
handed off; `colocated`: one colocated worker) with a trace receiver in this process as
its OTLP collector, sends `--num-requests` requests one after another and lays every
request's spans on one time line from the router's receipt of the call. For each span
(router, workers) it reports the median start, end and length over the requests (the
first `--warmup` left out), next to the client's TTFT, the router's own TTFT and the
wait to be accepted; the gaps between spans are the hops between processes. With
`--load-concurrency`, as many requests are traced again after a closed-loop load of
`--load-requests` at that concurrency (a worker's pass at concurrency 1 is bound by its
host, whose state a load changes). Prints the tables and writes them, with provenance,
as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness.otlp import OTLPSink, ReceivedSpan
from bench.harness.service import service_process
from bench.report import percentile, provenance
from bench.suite_common import make_prompts
from bench.suite_service import drive

LOAD_OUTPUT_TOKENS = 128  # each load request's output: a chat-length decode
POOL_ARGS = {
    "1p1d": ["--prefill-workers", "1", "--decode-workers", "1", "--local-prefill-max-tokens", "0"],
    "colocated": ["--colocated-workers", "1"],
}
ROOT = "pdserve.v1.GenerationService/Generate"
# The services whose spans each request's trace holds: every process on its path.
SERVICES = {
    "1p1d": {"pdserve-router", "pdserve-prefill", "pdserve-decode"},
    "colocated": {"pdserve-router", "pdserve-colocated"},
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--system", choices=sorted(POOL_ARGS), default="1p1d")
    p.add_argument("--num-requests", type=int, default=24)
    p.add_argument("--warmup", type=int, default=4, help="first requests left out")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=49152, help="of the model served")
    p.add_argument("--serve-args", default="", help="more `pdserve serve` flags")
    p.add_argument(
        "--load-concurrency",
        type=int,
        default=0,
        help="trace again after a closed-loop load at this concurrency (0: no load)",
    )
    p.add_argument("--load-requests", type=int, default=256, help="requests of that load")
    p.add_argument("--log", help="the service's log (default: a temporary file)")
    p.add_argument("--out", help="JSON result")
    return p.parse_args(argv)


def timeline(traces: list[list[ReceivedSpan]]) -> list[dict[str, Any]]:
    """Each span name's median start, end and length (ms) from its trace's root span,
    over the traces that have it, in order of median start."""
    by_name: dict[str, list[tuple[float, float]]] = {}
    for spans in traces:
        root = next(s for s in spans if s.name == ROOT)
        for s in spans:
            key = f"{s.service}: {s.name}"
            by_name.setdefault(key, []).append(
                ((s.start_ns - root.start_ns) / 1e6, (s.end_ns - root.start_ns) / 1e6)
            )
    rows = [
        {
            "span": name,
            "start_ms": round(percentile((a for a, _ in times), 50), 3),
            "end_ms": round(percentile((b for _, b in times), 50), 3),
            "length_ms": round(percentile((b - a for a, b in times), 50), 3),
            "count": len(times),
        }
        for name, times in by_name.items()
    ]
    return sorted(rows, key=lambda r: (r["start_ms"], r["end_ms"]))


def whole_traces(spans: list[ReceivedSpan]) -> list[list[ReceivedSpan]]:
    """The traces that have their root span, in order of the root's start."""
    traces: dict[str, list[ReceivedSpan]] = {}
    for s in spans:
        traces.setdefault(s.trace_id, []).append(s)
    whole = [t for t in traces.values() if any(s.name == ROOT for s in t)]
    return sorted(whole, key=lambda t: next(s.start_ns for s in t if s.name == ROOT))


def median_ms(values: list[float]) -> float:
    return round(1000 * percentile(values, 50), 3)


def traced_round(
    args: argparse.Namespace, sink: OTLPSink, address: str, seed: int
) -> dict[str, Any]:
    """`--num-requests` requests one after another; their spans from the traces that
    began with this round (the first `--warmup` left out)."""
    began_ns = time.time_ns()

    def this_rounds() -> list[list[ReceivedSpan]]:
        return [t for t in whole_traces(sink.spans) if _root(t).start_ns >= began_ns]

    prompts = make_prompts(args.num_requests, args.prompt_tokens, args.vocab_size, seed=seed)
    timings, _ = asyncio.run(drive(address, prompts, args.max_tokens, concurrency=1))
    # Spans are exported in batches, each process on its own schedule: wait until every
    # request's trace holds spans of every process on its path.
    wanted = SERVICES[args.system]

    def complete() -> bool:
        traces = this_rounds()
        return len(traces) >= len(prompts) and all(wanted <= {s.service for s in t} for t in traces)

    deadline = time.monotonic() + 30
    while not complete() and time.monotonic() < deadline:
        time.sleep(0.2)
    traces = this_rounds()[args.warmup :]
    kept = [t for t in timings[args.warmup :] if t.ok]
    client = median_ms([t.ttft_s for t in kept if t.ttft_s is not None])
    router = median_ms([t.router_ttft_s for t in kept if t.router_ttft_s])
    return {
        "requests": len(kept),
        "traces": len(traces),
        "client_ttft_ms_p50": client,
        "accept_ms_p50": median_ms([t.accepted_s - t.sent_s for t in kept if t.accepted_s]),
        "router_ttft_ms_p50": router,
        "edge_ms_p50": round(client - router, 3),
        "errors": sorted({t.error for t in timings if not t.ok})[:5],
        "spans": timeline(traces),
    }


def _root(trace: list[ReceivedSpan]) -> ReceivedSpan:
    return next(s for s in trace if s.name == ROOT)


def measure(args: argparse.Namespace, log: Path) -> dict[str, Any]:
    serve_args = [*POOL_ARGS[args.system], "--stream-interval", "1", *shlex.split(args.serve_args)]
    traced = [*serve_args, "--otlp-traces-endpoint"]
    with OTLPSink() as sink, service_process([*traced, sink.endpoint], log) as svc:
        svc.wait_serving(900)
        result = traced_round(args, sink, svc.address, seed=5)
        if args.load_concurrency > 0:
            load = make_prompts(args.load_requests, args.prompt_tokens, args.vocab_size, 6)
            timings, wall = asyncio.run(
                drive(svc.address, load, LOAD_OUTPUT_TOKENS, concurrency=args.load_concurrency)
            )
            after = traced_round(args, sink, svc.address, seed=7)
            after["load"] = {
                "concurrency": args.load_concurrency,
                "requests": len(timings),
                "ok": sum(t.ok for t in timings),
                "output_tok_s": round(sum(t.num_tokens for t in timings) / wall, 1),
            }
            result["after_load"] = after
    return {
        "system": args.system,
        "prompt_tokens": args.prompt_tokens,
        **result,
        "serve_args": serve_args,
    }


def print_summary(result: dict[str, Any], title: str = "") -> None:
    print(
        f"{title}{result['system']}, {result['prompt_tokens']}-token prompts, "
        f"{result['traces']} traces: client TTFT p50 {result['client_ttft_ms_p50']} ms, "
        f"router's own {result['router_ttft_ms_p50']} ms (edge {result['edge_ms_p50']} ms, "
        f"of it accept {result['accept_ms_p50']} ms)"
    )
    print(f"{'span':60s} {'start':>8s} {'end':>8s} {'length':>8s}  (ms from the router's receipt)")
    for row in result["spans"]:
        print(
            f"{row['span'][:60]:60s} {row['start_ms']:8.2f} {row['end_ms']:8.2f} "
            f"{row['length_ms']:8.2f}"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log = Path(args.log or tempfile.mkstemp(prefix="ttft-trace-", suffix=".log")[1])
    print(f"service log: {log}", flush=True)
    result = measure(args, log)
    result["provenance"] = provenance("bench.ttft_trace", sys.argv[1:] if argv is None else argv)
    print_summary(result)
    if "after_load" in result:
        after = {**result, **result["after_load"]}
        load = after["load"]
        title = f"after {load['requests']} requests at concurrency {load['concurrency']}: "
        print_summary(after, title)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    rounds = [result, *([result["after_load"]] if "after_load" in result else [])]
    return 0 if all(r["requests"] and not r["errors"] for r in rounds) else 1


if __name__ == "__main__":
    sys.exit(main())
