"""Drain a decode worker under load: how long it takes, and what its requests notice.

A 1P2D service gets `--num-requests` long generations at once; once all decode, the
decode pool shrinks to one and decode-1's requests move to decode-0 with their KV. It
reports the scale-down's time, the requests moved, each stream's largest gap between
token messages during the drain against before it, and each move's pause from the log.
Every request must complete, each moved one with its KV; a drain that moved nothing
fails (raise `--max-tokens`).

    python -m bench.drain --out drain.json                       # CPU, small
    python -m bench.drain --num-requests 64 --prompt-tokens 600 --max-tokens 4096 \\
        --vocab-size 128256 \\
        --serve-args "--model deploy/model_configs/llama-3.2-1b --load-format dummy"   # GPUs
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness.metrics import scrape
from bench.harness.metrics import value as metric_value
from bench.harness.polling import wait_until_async
from bench.harness.service import service_process
from bench.harness.streams import TimedStream
from bench.report import distribution, write_result
from pdserve.v1 import generation_pb2 as pb
from router.cli.admin_client import scale_pool
from router.cli.client import get_pool_stats


class Stream(TimedStream):
    """One request's token messages, timed, and how it ended."""

    def completed(self) -> bool:
        return self.result is not None and self.result.finish_reason == "FINISH_REASON_LENGTH"

    def ended_before(self, at: float) -> bool:
        return self.result is not None and self.result.done_at < at

    def tokens_between(self, start: float, end: float) -> int:
        """Token messages that arrived within [start, end] (one token each here)."""
        return sum(start <= t <= end for t in self.times)

    def largest_gap(self, start: float, end: float) -> float:
        """The longest wait for a message, among waits that end within [start, end]."""
        times = self.times
        gaps = [b - a for a, b in zip(times, times[1:], strict=False) if start <= b <= end]
        return max(gaps, default=0.0)


_PAUSED = re.compile(r"moved from \S+ to \S+ with its KV \(\d+ tokens, ([\d.]+) ms paused")
_MOVED = re.compile(r": (\d+) of (\d+) requests moved with their KV in ([\d.]+) s")
_STOPPED = re.compile(
    r"drained and stopped \((\d+) peer channels closed in ([\d.]+) s, stopped in ([\d.]+) s\)"
)


def drain_phases(log_text: str) -> dict[str, Any]:
    """What the router logged of a drain: each moved request's pause, how long the moves
    took, closing the peers' channels and stopping the worker (absent where the log
    has no such line)."""
    out: dict[str, Any] = {}
    pauses = [float(m.group(1)) for m in _PAUSED.finditer(log_text)]
    if pauses:
        out["paused_ms"] = distribution(pauses)
        out["paused_ms"]["max"] = max(pauses)
    if moved := _MOVED.search(log_text):
        out["moves_s"] = float(moved.group(3))
    if stopped := _STOPPED.search(log_text):
        out["close_peer_channels_s"] = float(stopped.group(2))
        out["stop_worker_s"] = float(stopped.group(3))
    return out


def moves(samples: Any, reason: str) -> float:
    labels = {"pool": "decode", "reason": reason}
    return metric_value(samples, "pdserve_request_migrations_total", **labels)


async def measure(address: str, metrics_port: int, args: argparse.Namespace) -> dict[str, Any]:
    await scale_pool(address, "decode", 2)
    rng = random.Random(args.seed)
    prompts = [
        [rng.randrange(100, args.vocab_size) for _ in range(args.prompt_tokens)]
        for _ in range(args.num_requests)
    ]
    streams = [Stream() for _ in prompts]
    greedy = {"max_tokens": args.max_tokens, "temperature": 0.0, "ignore_eos": True}
    tasks = [
        asyncio.ensure_future(s.run(address, prompt_token_ids=p, **greedy))
        for p, s in zip(prompts, streams, strict=True)
    ]
    await wait_until_async(
        lambda: all(s.num_tokens >= 3 for s in streams), args.start_timeout_s, interval=0.05
    )
    steady_from = time.monotonic()
    await asyncio.sleep(args.steady_s)  # ordinary gaps, to compare with
    stats = await get_pool_stats(address)
    on_worker = {w.index: w.num_running for w in stats.workers if w.pool == pb.POOL_DECODE}
    before = scrape(metrics_port)[1]
    start = time.monotonic()
    await scale_pool(address, "decode", 1)
    drain_s = time.monotonic() - start
    await asyncio.sleep(1.0)
    after = scrape(metrics_port)[1]
    await asyncio.gather(*tasks)
    window_end = start + drain_s + 1.0
    return {
        "num_requests": args.num_requests,
        "prompt_tokens": args.prompt_tokens,
        "running_per_decode_worker_before": on_worker,
        "drain_s": drain_s,
        "moved_with_kv": moves(after, "drained_kv") - moves(before, "drained_kv"),
        "moved_by_recompute": moves(after, "drained") - moves(before, "drained"),
        "completed": sum(s.completed() for s in streams),
        "ended_before_drain": sum(s.ended_before(start) for s in streams),
        "tokens_per_s_per_stream_before": sum(s.tokens_between(steady_from, start) for s in streams)
        / (len(streams) * (start - steady_from)),
        "largest_gap_during_drain_ms": 1e3 * max(s.largest_gap(start, window_end) for s in streams),
        "gap_during_drain_ms": distribution(
            (s.largest_gap(start, window_end) for s in streams), scale=1e3
        ),
        "largest_gap_before_ms": 1e3 * max(s.largest_gap(steady_from, start) for s in streams),
    }


def problems(summary: dict[str, Any], num_requests: int, max_tokens: int) -> list[str]:
    """What makes a run a failure, each said so that the next run can avoid it."""
    found = []
    num_moved = summary["moved_with_kv"] + summary["moved_by_recompute"]
    if not num_moved:
        rate = summary["tokens_per_s_per_stream_before"]
        found.append(
            f"the drain moved no request, so it measured nothing: "
            f"{summary['ended_before_drain']} of {num_requests} requests had ended before "
            f"it began (about {rate:.0f} tokens/s a stream; raise --max-tokens above "
            f"{max_tokens} so that they outlast the wait before the drain)"
        )
    if summary["completed"] != num_requests:
        found.append(f"{num_requests - summary['completed']} of {num_requests} did not complete")
    if summary["moved_by_recompute"]:
        found.append(f"{summary['moved_by_recompute']:g} requests moved by recompute, not KV")
    return found


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.drain", description=__doc__.split("\n")[0])
    p.add_argument("--num-requests", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=200, help="long enough to outlast it")
    p.add_argument("--vocab-size", type=int, default=49152, help="prompt token ids below it")
    p.add_argument("--steady-s", type=float, default=2.0, help="gaps measured before it")
    p.add_argument("--start-timeout-s", type=float, default=300.0)
    p.add_argument("--serve-args", default="", help="more `pdserve serve` flags")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the summary as JSON here")
    p.add_argument("--log", help="the service's log (default: a temporary file)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # One token a message: the gaps between messages are then the pauses a drain causes,
    # not tokens grouped by the router (`--serve-args` may still set another interval).
    serve_args = [
        "--prefill-workers", "1", "--decode-workers", "2", "--enable-admin",
        "--local-prefill-max-tokens", "0", "--stream-interval", "1",
        *shlex.split(args.serve_args),
    ]  # fmt: skip
    log = Path(args.log or tempfile.mkstemp(prefix="drain-", suffix=".log")[1])
    print(f"service log: {log}", flush=True)
    with service_process(serve_args, log) as svc:
        svc.wait_serving(900)
        summary = asyncio.run(measure(svc.address, svc.metrics_port, args))
    summary.update(drain_phases(log.read_text(errors="replace")))
    summary["serve_args"] = serve_args
    print(json.dumps(summary, indent=1))
    if args.out:
        write_result(args.out, "bench.drain", argv, **summary)
    failed = problems(summary, args.num_requests, args.max_tokens)
    for problem in failed:
        print(f"bench.drain: FAILED: {problem}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
