"""The router's calls to its workers, over their own connections (`--worker-calls
direct`) against Ray actor calls (`ray`): the router's CPU per request, throughput and
TTFT of the same closed loop, services started one after another, alternating.

    python -m bench.worker_calls --out worker_calls.json        # CPU, a tiny random Llama
    python -m bench.worker_calls --serve-args "--model deploy/model_configs/llama-3.2-1b \\
        --load-format dummy" --vocab-size 128256 --prompt-tokens 512 --max-tokens 128 \\
        --concurrency 128 --num-requests 512                       # GPUs

CPU per request: user + system time over the timed loop divided by the requests sent,
of the router's process (Ray's threads in it included) and of the router with its worker
actors (Linux: read from /proc).
Prints one line per round and mode, then the means; writes them, with provenance, as
JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.harness import ServiceProcess
from bench.harness.cpu import process_cpu_s, service_cpu_s
from bench.report import provenance
from bench.suite_common import make_prompts, shape_path, summarize
from bench.suite_service import drive

MODES = ("direct", "ray")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2, help="of each mode, alternating")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--vocab-size", type=int, default=2000, help="of the model served")
    p.add_argument(
        "--serve-args", default="", help="`pdserve serve` flags (default: a tiny random Llama)"
    )
    p.add_argument("--out", help="JSON result")
    return p.parse_args(argv)


def one_run(args: argparse.Namespace, mode: str, serve_args: list[str], seed: int) -> dict:
    log = Path(tempfile.mkstemp(prefix=f"worker-calls-{mode}-", suffix=".log")[1])
    svc = ServiceProcess([*serve_args, "--worker-calls", mode], log)
    try:
        svc.wait_serving(900)
        warm = make_prompts(args.concurrency, args.prompt_tokens, args.vocab_size, seed=1)
        asyncio.run(drive(svc.address, warm, 4, concurrency=args.concurrency))
        prompts = make_prompts(args.num_requests, args.prompt_tokens, args.vocab_size, seed)
        router_before, service_before = process_cpu_s(svc.proc.pid), service_cpu_s(svc.proc.pid)
        timings, wall = asyncio.run(
            drive(svc.address, prompts, args.max_tokens, concurrency=args.concurrency)
        )
        router_used = process_cpu_s(svc.proc.pid) - router_before
        service_used = service_cpu_s(svc.proc.pid) - service_before
    finally:
        svc.stop()
    run = summarize(mode, args.concurrency, timings, wall)
    run["router_cpu_ms_per_request"] = round(1000 * router_used / len(prompts), 3)
    run["service_cpu_ms_per_request"] = round(1000 * service_used / len(prompts), 3)
    return run


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    serve_args = shlex.split(args.serve_args)
    if not serve_args:
        model = shape_path("tiny", Path(tempfile.mkdtemp(prefix="worker-calls-")))
        serve_args = ["--model", str(model), "--load-format", "dummy"]
    serve_args += ["--decode-max-num-seqs", str(max(64, args.concurrency))]
    runs: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        for mode in MODES:
            run = one_run(args, mode, serve_args, seed=2 + rnd)
            runs.append(run)
            print(
                f"round {rnd} {mode:6s} CPU ms a request: router "
                f"{run['router_cpu_ms_per_request']:6.2f}, with workers "
                f"{run['service_cpu_ms_per_request']:6.2f}  {run['output_tok_s']:8.1f} tok/s  "
                f"TTFT p50 {run['ttft_ms']['p50']:7.1f} ms  "
                f"ok {run['num_ok']}/{run['num_requests']}",
                flush=True,
            )
    means = {
        mode: {
            key: round(statistics.mean(r[key] for r in runs if r["system"] == mode), 3)
            for key in ("router_cpu_ms_per_request", "service_cpu_ms_per_request", "output_tok_s")
        }
        for mode in MODES
    }
    for mode, mean in means.items():
        print(f"mean   {mode:6s} {mean}")
    result = {"runs": runs, "means": means, "serve_args": serve_args}
    result["provenance"] = provenance("bench.worker_calls", sys.argv[1:] if argv is None else argv)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0 if all(r["num_ok"] == r["num_requests"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
