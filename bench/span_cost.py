"""The CPU time tracing adds to one request, measured in this process where a service's
latency under other load would hide it: the router's serving core over fake workers
(`bench/fake_workers.py`), and the worker side's phase spans, each with tracing off and
on (every request sampled, spans batched and sent over OTLP/gRPC to a receiver in a
process of its own). CPU time is this process's (`time.process_time()`), the
exporter's thread included.

Usage: python -m bench.span_cost [--requests 400]   (bench.tracing_cost runs it too)
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import time
from multiprocessing.connection import Connection
from typing import Any

from bench.fake_workers import FakePools, WordTokenizer
from bench.harness.otlp import OTLPSink
from engine import tracing
from engine.sampling_params import SamplingParams
from engine.transfer.base import KVPoll
from engine.transfer.handoff import HandoffEntry, HandoffHeader, HandoffTarget, HeaderKind
from engine.transfer.receiver import KVArrival
from engine.wire import GenerationInput, TokenUpdate
from engine.worker.phases import (
    Waiting,
    arrival_phases,
    decode_start_phases,
    prompt_phases,
    record_kv_send,
)
from router.serving.config import RouterConfig
from router.serving.orchestrator import DisaggregatedGenerator
from router.serving.protocol import GenerateCall

PROMPT = tuple(range(100, 356))  # 256 tokens: prefilled remotely, handed off
OUTPUT_TOKENS = 32
CONCURRENCY = 8


def router_cpu_us(num_requests: int) -> float:
    """CPU µs per request of the serving core (routing, attempts, streaming, spans)."""

    async def body() -> None:
        pools = FakePools(1, 1, step_s=0.001)
        gen = DisaggregatedGenerator(
            pools,
            WordTokenizer(),
            RouterConfig(retry_delay_s=0.0, local_prefill_max_tokens=0),
        )
        gen.start()
        params = SamplingParams(max_tokens=OUTPUT_TOKENS, seed=1, ignore_eos=True)
        call = GenerateCall("", None, PROMPT, None, params)
        slots = asyncio.Semaphore(CONCURRENCY)

        async def one() -> None:
            async with slots:
                async for _ in gen.generate(call):
                    pass

        await asyncio.gather(*(one() for _ in range(num_requests)))
        await gen.stop()

    start = time.process_time()
    asyncio.run(body())
    return (time.process_time() - start) / num_requests * 1e6


def worker_cpu_us(num_requests: int, traced: bool) -> float:
    """CPU µs per request of the workers' phase hooks (prefill and decode side)."""
    carrier: dict[str, str] = {}
    if traced:
        parent = tracing.start("router.attempt", tracing.extract({}), time.time_ns())
        carrier = tracing.inject(parent)
        parent.end()
    inp = GenerationInput("r", PROMPT, SamplingParams(), trace_context=carrier)
    entry = HandoffEntry("r", len(PROMPT), 16, 7)
    header = HandoffHeader(HeaderKind.HANDOFF, 0, 3, 5, (entry,), 1 << 20, time.time_ns() // 1000)
    target = HandoffTarget("decode-0", 3)
    start = time.process_time()
    for _ in range(num_requests):
        now = time.monotonic()
        first = TokenUpdate("r", (7,), None, 0, True, scheduled_at=now)
        prompt_phases("prefill", "prefill-0", inp, now, first, now)
        record_kv_send("prefill-0", inp, target, header, 1 << 20, (now, now), KVPoll.SUCCESS)
        arrival_phases("decode-0", KVArrival(inp, "prefill-0", header, 1 << 20, 0.001, 0.002, now))
        decode_start_phases("decode-0", Waiting(inp, now, True), first, now)
    return (time.process_time() - start) / num_requests * 1e6


def _receive(conn: Connection) -> None:
    """A collector in a process of its own: its CPU time is not the sender's."""
    with OTLPSink() as sink:
        conn.send(sink.endpoint)
        conn.recv()  # until the measurement is over
        conn.send(len(sink.spans))


def measure(num_requests: int) -> dict[str, Any]:
    """Router and worker CPU µs per request, tracing off and on."""
    out: dict[str, Any] = {"requests": num_requests, "output_tokens": OUTPUT_TOKENS}
    router_cpu_us(20)  # warm-up: imports, first-call costs
    out["router_off_us"] = router_cpu_us(num_requests)
    out["worker_off_us"] = worker_cpu_us(num_requests, traced=False)
    ours, theirs = mp.get_context("spawn").Pipe()
    collector = mp.get_context("spawn").Process(target=_receive, args=(theirs,), daemon=True)
    collector.start()
    try:
        tracing.configure(tracing.TracingConfig(ours.recv()), "pdserve-bench")
        try:
            router_cpu_us(20)
            out["router_on_us"] = router_cpu_us(num_requests)
            out["worker_on_us"] = worker_cpu_us(num_requests, traced=True)
        finally:
            tracing.shutdown()  # sends what is still buffered
        ours.send("done")
        out["spans_received"] = ours.recv()
    finally:
        collector.join(10)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--requests", type=int, default=400)
    ns = p.parse_args()
    r = measure(ns.requests)
    print(f"CPU µs per request ({ns.requests} requests, {OUTPUT_TOKENS} tokens each)")
    print(f"router (serving core)  off {r['router_off_us']:8.0f}   on {r['router_on_us']:8.0f}")
    print(f"workers (phase hooks)  off {r['worker_off_us']:8.0f}   on {r['worker_on_us']:8.0f}")
    print(f"spans received: {r['spans_received']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
