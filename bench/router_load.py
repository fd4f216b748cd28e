"""How many tokens a second the router itself can stream, with workers that cost nothing:
N router processes on one port (`--router-processes 1,2,4`, as `pdserve serve
--router-processes N` runs them), each over fake workers of its own (bench.fake_workers)
whose decode step takes `--step-ms`, driven by the suite's closed loop from
`--client-processes` per router process; tokens a second at each N and the ratio to N = 1.

    python -m bench.router_load --concurrency 128 --requests 512 --profile out.prof
    python -m bench.router_load --stream-intervals 1,4,auto   # each in turn, one table
    python -m bench.router_load --detokenize   # with text, as for a served model
    python -m bench.router_load --router-processes 1,2,4 --concurrency 256 --requests 2048
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from typing import Any

from bench.fake_workers import FakePools
from bench.harness.ports import free_port
from bench.report import percentile, text_table, write_result
from router.edge.streams import StreamInterval

# Connections each client process opens per router process: enough that the kernel's
# hash of their addresses deals every process a fair share.
CONNECTIONS_PER_ROUTER = 8
MAX_IN_FLIGHT = 4096


def _serve(
    port: int,
    args: argparse.Namespace,
    interval: StreamInterval,
    ready: Any,
    done: Any,
    tier: tuple[int, int, str] | None = None,
    served: Any = None,
) -> None:
    """One router process over fakes of its own; `tier`: (its index, the tier's size,
    the shared admission table's file) when it is one of several on the port. It
    writes the requests it completed into `served[index]`."""
    from router.edge.grpc_server import serve
    from router.observability.metrics import get_metrics
    from router.serving.config import RouterConfig
    from router.serving.orchestrator import DisaggregatedGenerator
    from router.tier.shared_admission import AdmissionTable, SharedAdmission

    async def main() -> None:
        pools = FakePools(1, 1, step_s=args.step_ms / 1000, steps_by_clock=True)
        tokenizer = None
        if args.detokenize:
            from engine.model.embedded import ensure_embedded_model
            from engine.model.model_loader import load_tokenizer

            tokenizer = load_tokenizer(str(ensure_embedded_model()))
        admission = None
        if tier is not None:
            index, size, table_path = tier
            table = AdmissionTable(table_path, size)
            admission = SharedAdmission(table, index, MAX_IN_FLIGHT, 1024)
        core = DisaggregatedGenerator(
            pools,
            tokenizer,
            RouterConfig(
                max_in_flight=MAX_IN_FLIGHT, local_prefill_max_tokens=0, stream_interval=interval
            ),
            admission,
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
            reuse_port=tier is not None,
        )

    # One router process's profile (the first's, when there are several).
    profiler = cProfile.Profile() if args.profile and (tier is None or tier[0] == 0) else None
    if profiler is not None:
        profiler.enable()
    try:
        asyncio.run(main())
        if served is not None:
            completed = get_metrics().registry.get_sample_value(
                "pdserve_requests_total", {"finish_reason": "length"}
            )
            served[0 if tier is None else tier[0]] = int(completed or 0)
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
    p.add_argument(
        "--router-processes",
        default="1",
        help="comma-separated router tier sizes, each run in turn (e.g. 1,2,4); "
        "--client-processes is then per router process",
    )
    args = p.parse_args(argv)
    intervals: list[StreamInterval] = [
        v if v == "auto" else int(v) for v in args.stream_intervals.split(",")
    ]
    sizes = [int(n) for n in args.router_processes.split(",")]
    if any(n < 1 for n in sizes):
        p.error("--router-processes: sizes of 1 or more")
    runs = [_run(args, interval, n) for n in sizes for interval in intervals]
    if any(r is None for r in runs):
        return 1
    result = {
        "concurrency": args.concurrency,
        "requests": args.requests,
        "client_processes": args.client_processes,  # per router process
        "router_processes": sizes,
        "step_ms": args.step_ms,
        "detokenize": args.detokenize,
        "offered_tok_s": round(args.concurrency / (args.step_ms / 1000), 1),
        "runs": runs,
    }
    # Each run against the first of its stream interval: N = 1 when the sizes start there.
    base = {r["stream_interval"]: r["tok_s"] for r in reversed(runs) if r is not None}
    for r in runs:
        assert r is not None
        r["ratio"] = round(r["tok_s"] / base[r["stream_interval"]], 2)
    print(
        f"router over fake workers, {args.concurrency} streams "
        f"(workers offer {result['offered_tok_s']} tok/s)"
    )
    keys = "router_processes stream_interval tok_s ratio messages_per_request ttft_ms_p50"
    keys += " accept_ms_p50 tpot_ms_p50 message_gap_ms_p50 message_gap_ms_p99"
    rows = [[*(str(r[k]) for k in keys.split()), f"{r['ok']}/{args.requests}"] for r in runs if r]
    head = ["routers", "interval", "tok/s", "ratio", "msgs/req", "TTFT p50 ms", "accept p50 ms"]
    head += ["TPOT p50", "gap p50", "gap p99", "ok"]
    print("\n".join(text_table(head, rows, left=0)))
    if args.out:
        write_result(args.out, "bench.router_load", argv, **result)
    return 0 if all(r is not None and r["ok"] == args.requests for r in runs) else 1


def _run(
    args: argparse.Namespace, interval: StreamInterval, num_routers: int = 1
) -> dict[str, Any] | None:
    """`num_routers` router processes at `interval`, driven by this one's closed loop."""
    from bench.suite_service import drive_processes
    from router.tier.shared_admission import AdmissionTable

    port = free_port()
    ctx = mp.get_context("spawn")
    done = ctx.Event()
    folder = tempfile.mkdtemp(prefix="router-load-")
    table = None
    if num_routers > 1:
        table = AdmissionTable(os.path.join(folder, "admission"), num_routers, create=True)
    servers, readies = [], []
    served = ctx.Array("i", num_routers)
    for index in range(num_routers):
        ready = ctx.Event()
        tier = None if table is None else (index, num_routers, table.path)
        server = ctx.Process(target=_serve, args=(port, args, interval, ready, done, tier, served))
        server.start()
        servers.append(server)
        readies.append(ready)
        # The first binds the port (and a free one found); the rest share it.
        if index == 0 and not ready.wait(60):
            break
    if not all(ready.wait(60) for ready in readies):
        for server in servers:
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
        processes=args.client_processes * num_routers,
        channels=CONNECTIONS_PER_ROUTER if num_routers > 1 else 4,
        connections=num_routers > 1,
    )
    elapsed = time.perf_counter() - start
    done.set()
    for server in servers:
        server.join(30)
    if table is not None:
        table.close()
    shutil.rmtree(folder, ignore_errors=True)
    ok = [t for t in timings if t.ok]
    tokens = sum(t.num_tokens for t in ok)
    ttfts = [t.ttft_s for t in ok if t.ttft_s is not None]
    accepts = [t.accepted_s - t.sent_s for t in ok if t.accepted_s is not None]
    gaps = [g for t in ok for g in t.gaps_s]  # between a stream's messages, as the client saw
    tpots = [t.tpot_s for t in ok if t.tpot_s is not None]
    return {
        "router_processes": num_routers,
        "requests_per_router": served[:],  # how the kernel dealt the connections
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
