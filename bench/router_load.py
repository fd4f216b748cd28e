"""How many tokens a second the router itself can stream, with workers that cost nothing.

The router (gRPC edge, serving core, token delivery) runs in this process over fake
workers (`bench/fake_workers.py`) whose decode step takes `--step-ms` and produces one
token for every running request, so the only limit is the router's own event loop. The
fake decode worker steps by the clock, as a real engine does between the router's
polls: a slow router gets more tokens per poll, not fewer tokens.
A client process drives it with the suite's closed loop. Compare the result with the
tokens per second a GPU delivers: where the router's ceiling is near it, the router,
not the GPU, sets the service's throughput.

    python -m bench.router_load --concurrency 128 --requests 512 --profile out.prof
    python -m bench.router_load --stream-intervals 1,4,auto   # each in turn, one table
    python -m bench.router_load --concurrency 128 --client-processes 4   # cores to spare
    python -m bench.router_load --detokenize   # with text, as for a served model
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import multiprocessing as mp
import os
import sys
import time
from typing import Any

from bench.fake_workers import FakePools
from bench.report import percentile, provenance
from bench.suite_common import free_port
from router.edge.streams import StreamInterval


def _serve(
    port: int, args: argparse.Namespace, interval: StreamInterval, ready: Any, done: Any
) -> None:
    from router.edge.grpc_server import serve
    from router.observability.metrics import get_metrics
    from router.serving.config import RouterConfig
    from router.serving.orchestrator import DisaggregatedGenerator

    async def main() -> None:
        pools = FakePools(1, 1, step_s=args.step_ms / 1000, steps_by_clock=True)
        tokenizer = None
        if args.detokenize:
            from engine.model.embedded import ensure_embedded_model
            from engine.model.model_loader import load_tokenizer

            tokenizer = load_tokenizer(str(ensure_embedded_model()))
        core = DisaggregatedGenerator(
            pools,
            tokenizer,
            RouterConfig(max_in_flight=4096, local_prefill_max_tokens=0, stream_interval=interval),
        )
        core.start()

        async def stop_when_done() -> None:
            while not done.is_set():
                await asyncio.sleep(0.1)
            os.kill(os.getpid(), 15)

        asyncio.ensure_future(stop_when_done())
        await serve(
            core,
            "127.0.0.1",
            port,
            drain_grace_s=1.0,
            on_started=lambda _server: ready.set(),
            metrics=get_metrics(),
        )

    profiler = cProfile.Profile() if args.profile else None
    if profiler is not None:
        profiler.enable()
    try:
        asyncio.run(main())
    finally:
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(args.profile)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--concurrency", type=int, default=128)
    p.add_argument("--requests", type=int, default=512)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--step-ms", type=float, default=2.0, help="fake decode step")
    p.add_argument("--profile", help="write the router's cProfile stats here")
    p.add_argument("--out", help="JSON results")
    p.add_argument(
        "--client-processes",
        type=int,
        default=1,
        help="client processes sharing the closed loop (where one client cannot read as fast "
        "as the router sends: on a host with cores to spare)",
    )
    p.add_argument(
        "--detokenize",
        action="store_true",
        help="the router turns tokens into text with the embedded model's tokenizer, as it "
        "does for a served model (default: token ids only)",
    )
    p.add_argument(
        "--stream-intervals",
        default="1",
        help="comma-separated --stream-interval values, each run in turn (e.g. 1,4,auto)",
    )
    args = p.parse_args(argv)
    intervals: list[StreamInterval] = [
        v if v == "auto" else int(v) for v in args.stream_intervals.split(",")
    ]
    runs = [_run(args, interval) for interval in intervals]
    if any(r is None for r in runs):
        return 1
    result = {
        "provenance": provenance("bench.router_load", sys.argv[1:] if argv is None else argv),
        "concurrency": args.concurrency,
        "requests": args.requests,
        "client_processes": args.client_processes,
        "step_ms": args.step_ms,
        "detokenize": args.detokenize,
        "offered_tok_s": round(args.concurrency / (args.step_ms / 1000), 1),
        "runs": runs,
    }
    base = runs[0]["tok_s"]  # type: ignore[index]
    print(
        f"router over fake workers, {args.concurrency} streams "
        f"(workers offer {result['offered_tok_s']} tok/s)"
    )
    print(
        f"{'interval':>8} {'tok/s':>9} {'ratio':>6} {'msgs/req':>8} {'TTFT p50 ms':>11} "
        f"{'accept p50 ms':>13} {'TPOT p50':>9} {'gap p50':>8} {'gap p99':>8} {'ok':>9}"
    )
    for r in runs:
        assert r is not None
        print(
            f"{r['stream_interval']:>8} {r['tok_s']:>9} {r['tok_s'] / base:>6.2f} "
            f"{r['messages_per_request']:>8} {r['ttft_ms_p50']!s:>11} {r['accept_ms_p50']!s:>13} "
            f"{r['tpot_ms_p50']!s:>9} {r['message_gap_ms_p50']!s:>8} "
            f"{r['message_gap_ms_p99']!s:>8} {r['ok']:>4}/{args.requests}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if all(r is not None and r["ok"] == args.requests for r in runs) else 1


def _run(args: argparse.Namespace, interval: StreamInterval) -> dict[str, Any] | None:
    """One router process at `interval`, driven by this one's closed loop."""
    from bench.suite_service import drive_processes

    port = free_port()
    ctx = mp.get_context("spawn")
    ready, done = ctx.Event(), ctx.Event()
    server = ctx.Process(target=_serve, args=(port, args, interval, ready, done))
    server.start()
    if not ready.wait(60):
        server.kill()
        print("router did not start", file=sys.stderr)
        return None
    prompts = [
        [100 + (i * 7 + j) % 1000 for j in range(args.prompt_len)] for i in range(args.requests)
    ]
    start = time.perf_counter()
    timings, wall = drive_processes(
        f"127.0.0.1:{port}",
        prompts,
        args.output_len,
        concurrency=args.concurrency,
        processes=args.client_processes,
    )
    elapsed = time.perf_counter() - start
    done.set()
    server.join(30)
    ok = [t for t in timings if t.ok]
    tokens = sum(t.num_tokens for t in ok)
    ttfts = [t.ttft_s for t in ok if t.ttft_s is not None]
    accepts = [t.accepted_s - t.sent_s for t in ok if t.accepted_s is not None]
    gaps = [g for t in ok for g in t.gaps_s]  # between a stream's messages, as the client saw
    tpots = [t.tpot_s for t in ok if t.tpot_s is not None]
    return {
        "stream_interval": interval,
        "ok": len(ok),
        "tok_s": round(tokens / wall, 1),
        "messages_per_request": round(sum(len(t.gaps_s) + 1 for t in ok) / max(len(ok), 1), 1),
        "ttft_ms_p50": round(1000 * percentile(ttfts, 50), 2) if ttfts else None,
        "accept_ms_p50": round(1000 * percentile(accepts, 50), 2) if accepts else None,
        "tpot_ms_p50": round(1000 * percentile(tpots, 50), 2) if tpots else None,
        "message_gap_ms_p50": round(1000 * percentile(gaps, 50), 2) if gaps else None,
        "message_gap_ms_p99": round(1000 * percentile(gaps, 99), 2) if gaps else None,
        "wall_s": round(elapsed, 2),
    }


if __name__ == "__main__":
    raise SystemExit(main())
