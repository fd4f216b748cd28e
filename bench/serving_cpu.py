"""1P1D service vs the colocated engine at the same concurrency, and the router's overhead.

Three systems, one workload (same prompts, same output lengths, greedy, ignore_eos),
closed loop at `--concurrency` requests in flight:
  engine     the colocated engine in this process (no gRPC, no Ray): the reference;
  colocated  `pdserve serve --colocated-workers 1`: router + one worker doing both phases
             (its TTFT minus the engine's = what the router and Ray add);
  1p1d       `pdserve serve`: router + 1 prefill + 1 decode worker, KV hand-off over gloo.
All three get the same prompts (`--seed`, fresh per run by default); each service's
warm-up request uses a prompt of its own, so no timed prompt meets a cached prefix.
Prints a table and writes JSON. Usage: python -m bench.serving_cpu [--concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness import ServiceProcess
from bench.load import build_requests, run_load, summarize
from bench.load import parse_args as load_args
from bench.report import percentile, provenance
from engine.core.config import SchedulerConfig
from engine.factory import EngineArgs
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.wire import GenerationInput


def run_engine(requests: list[Any], concurrency: int, kv_gib: float) -> dict[str, Any]:
    """Closed loop on the in-process engine; TTFT measured from add to first token."""
    llm = LLM(EngineArgs(kv_cache_gib=kv_gib, scheduler=SchedulerConfig(max_num_seqs=concurrency)))
    core = llm.core
    core.add_request(GenerationInput("warm", (1, 2, 3), SamplingParams(max_tokens=2)))
    while core.has_unfinished:
        core.step()
    pending = list(enumerate(requests))
    added: dict[str, float] = {}
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    counts: dict[str, int] = {}
    start = time.perf_counter()

    def admit() -> None:
        while pending and len(added) - len(done) < concurrency:
            i, (req, _) = pending.pop(0)
            sp = SamplingParams(
                max_tokens=req.sampling.max_tokens, temperature=0.0, ignore_eos=True
            )
            ids = tuple(req.prompt_token_ids.token_ids)
            core.add_request(GenerationInput(f"r{i}", ids, sp))
            added[f"r{i}"] = time.perf_counter()

    admit()
    while core.has_unfinished:
        for upd in core.step():
            now = time.perf_counter()
            first.setdefault(upd.req_id, now)
            counts[upd.req_id] = counts.get(upd.req_id, 0) + len(upd.new_token_ids)
            if upd.finish_reason is not None:
                done[upd.req_id] = now
        admit()
    duration = time.perf_counter() - start
    ttfts = [(first[r] - added[r]) * 1000 for r in added]
    tpots = [(done[r] - first[r]) * 1000 / (counts[r] - 1) for r in added if counts.get(r, 0) > 1]
    return {
        "output_token_throughput": sum(counts.values()) / duration,
        "duration_s": duration,
        "ttft_ms": {"p50": percentile(ttfts, 50), "p99": percentile(ttfts, 99)},
        "tpot_ms": {"p50": percentile(tpots, 50), "p99": percentile(tpots, 99)},
    }


def run_service(
    flags: list[str], argv: list[str], seed: int, log_dir: Path, name: str
) -> dict[str, Any]:
    svc = ServiceProcess(flags, log_dir / f"{name}.log")
    try:
        svc.wait_serving()
        args = load_args([*argv, "--seed", str(seed), "--target", svc.address])
        # One short request first so the first timed one pays no warm-up; another seed,
        # so its prompt is none of the timed ones (no prefix-cache hit for them).
        warm_argv = [*argv, "--seed", str(seed + 1), "--num-requests", "1"]
        asyncio.run(run_load(load_args([*warm_argv, "--target", svc.address])))
        return summarize(asyncio.run(run_load(args)), args)
    finally:
        svc.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prompt-len", default="32:256")
    p.add_argument("--output-len", default="16:64")
    p.add_argument("--kv-cache-gib", type=float, default=0.25)
    p.add_argument("--seed", type=int, help="the workload's seed (default: a fresh one)")
    p.add_argument("--out", default="bench/results/serving_cpu.json")
    ns = p.parse_args()
    if ns.seed is None:
        ns.seed = secrets.randbelow(2**31)
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
    workload = load_args([*argv, "--seed", str(ns.seed)])
    requests = build_requests(workload)
    kv = str(ns.kv_cache_gib)
    results: dict[str, Any] = {"engine": run_engine(requests, ns.concurrency, ns.kv_cache_gib)}
    sched = ["--decode-max-num-seqs", str(ns.concurrency)]
    with tempfile.TemporaryDirectory() as tmp:
        results["colocated"] = run_service(
            ["--colocated-workers", "1", "--decode-kv-cache-gib", kv, *sched],
            argv,
            ns.seed,
            Path(tmp),
            "colo",
        )
        results["1p1d"] = run_service(
            ["--prefill-kv-cache-gib", kv, "--decode-kv-cache-gib", kv, *sched],
            argv,
            ns.seed,
            Path(tmp),
            "pd",
        )
    base = results["engine"]
    print(
        f"\nconcurrency {ns.concurrency}, {ns.num_requests} requests, prompts {ns.prompt_len}, "
        f"outputs {ns.output_len}, seed {ns.seed}"
    )
    print(
        f"{'system':<10} {'completed':>10} {'out tok/s':>10} {'vs engine':>10} {'TTFT p50':>10} "
        f"{'TTFT p99':>10} {'TPOT p50':>10}"
    )
    for name, r in results.items():
        done = f"{r.get('num_completed', ns.num_requests)}/{ns.num_requests}"
        print(
            f"{name:<10} {done:>10} {r['output_token_throughput']:>10.1f} "
            f"{r['output_token_throughput'] / base['output_token_throughput']:>10.2f} "
            f"{r['ttft_ms']['p50']:>9.0f}ms {r['ttft_ms']['p99']:>9.0f}ms "
            f"{r['tpot_ms']['p50']:>8.1f}ms"
        )
    overhead = results["colocated"]["ttft_ms"]["p50"] - base["ttft_ms"]["p50"]
    print(f"router + Ray TTFT overhead (colocated service - engine, p50): {overhead:.0f} ms")
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(
        json.dumps(
            {
                "provenance": provenance("bench.serving_cpu", sys.argv[1:]),
                "params": vars(ns),
                "results": results,
                "router_ttft_overhead_ms_p50": overhead,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
