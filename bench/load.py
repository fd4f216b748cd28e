"""Load generator for GenerationService: TTFT, TPOT, inter-token latency, throughput, goodput.

Open loop (`--rate`, Poisson arrivals) or closed loop (`--concurrency`), a fixed
number of requests, then it stops. A request counts as completed only when its final
message says STOP or LENGTH; every other ending (ABORT, ERROR, a gRPC status such as
UNAVAILABLE) is reported by reason and left out of every latency, throughput and goodput
figure. Prompts are fresh random tokens on every run (so a rerun does not hit the prefix
cache the last one filled); `--seed N` repeats a run's prompts, and the summary gives the
share of prompt tokens the server found cached. Example:

    python -m bench.load --target 127.0.0.1:50051 --rate 8 --num-requests 200 \\
        --prompt-len 256:1024 --output-len 64:256 --ttft-slo 0.5 --tpot-slo 0.05 --out run.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import random
import secrets
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import grpc

from bench.report import distribution, fmt, text_table, write_result
from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import generation_pb2_grpc as pb_grpc
from router.cli.client import ClientSecurity, add_security_arguments

# Words for --text-prompts; token counts per word vary by tokenizer, so prompt
# lengths are approximate in that mode (usage.prompt_tokens reports the truth).
_WORD_TEXT = (
    "the of and to in is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there one all we their can has been if more "
    "when will would who so no time people year way day man thing woman life child world"
)
_WORDS = _WORD_TEXT.split()


COMPLETED = ("stop", "length")  # the finish reasons of a request that ran to its end


@dataclass
class Outcome:
    """What one request saw, in seconds since the benchmark started."""

    index: int
    prompt_len: int
    max_tokens: int
    sent_s: float = 0.0
    first_token_s: float | None = None
    done_s: float | None = None  # the final message's arrival
    end_s: float | None = None  # the call's end, whatever ended it
    chunk_times_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    finish_reason: str = ""  # "stop", "length", "abort", "error"; "" without a final
    status: str = "OK"  # the call's gRPC status code
    error: str = ""

    @property
    def completed(self) -> bool:
        """Ran to its end: a STOP or LENGTH final message and status OK."""
        return self.status == "OK" and self.finish_reason in COMPLETED

    @property
    def outcome(self) -> str:
        """'stop' or 'length' when completed; otherwise why not: the finish reason
        ('ABORT', 'ERROR'), else the gRPC status ('UNAVAILABLE'), else 'NO_FINAL'."""
        if self.completed:
            return self.finish_reason
        if self.finish_reason and self.finish_reason not in COMPLETED:
            return self.finish_reason.upper()
        if self.status != "OK":
            return self.status
        return "NO_FINAL"

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
        if self.first_token_s is None or not self.chunk_times_s or self.output_tokens < 2:
            return None
        return (self.chunk_times_s[-1] - self.first_token_s) / (self.output_tokens - 1)

    @property
    def latency_s(self) -> float | None:
        return None if self.done_s is None else self.done_s - self.sent_s


def parse_range(text: str) -> tuple[int, int]:
    """'128:512' -> (128, 512); '256' -> (256, 256)."""
    low, _, high = text.partition(":")
    lo, hi = int(low), int(high or low)
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX with 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


def build_requests(args: argparse.Namespace) -> list[tuple[pb.GenerateRequest, Outcome]]:
    """All requests up front (from `args.seed`), so generating them does not perturb
    arrival times."""
    rng = random.Random(args.seed)
    lo_id, hi_id = args.token_ids
    requests = []
    for i in range(args.num_requests):
        prompt_len = rng.randint(*args.prompt_len)
        max_tokens = rng.randint(*args.output_len)
        request = pb.GenerateRequest(
            request_id=f"bench-{args.seed}-{i}",
            sampling=pb.SamplingParams(
                max_tokens=max_tokens,
                temperature=args.temperature,
                seed=rng.getrandbits(32),
                ignore_eos=not args.allow_eos,
            ),
        )
        if args.text_prompts:
            request.prompt = " ".join(rng.choice(_WORDS) for _ in range(prompt_len))
        else:
            request.prompt_token_ids.token_ids.extend(
                rng.randrange(lo_id, hi_id) for _ in range(prompt_len)
            )
        requests.append((request, Outcome(i, prompt_len, max_tokens)))
    return requests


async def run_one(
    stub: pb_grpc.GenerationServiceStub,
    request: pb.GenerateRequest,
    outcome: Outcome,
    t0: float,
    timeout: float,
    metadata: tuple[tuple[str, str], ...] | None = None,
) -> None:
    """Send one request and record token arrival times into `outcome`."""
    outcome.sent_s = time.perf_counter() - t0
    try:
        async for response in stub.Generate(request, timeout=timeout, metadata=metadata):
            now = time.perf_counter() - t0
            if response.token_ids:
                if outcome.first_token_s is None:
                    outcome.first_token_s = now
                outcome.chunk_times_s.append(now)
                outcome.output_tokens += len(response.token_ids)
            if response.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                outcome.done_s = now
                name = pb.FinishReason.Name(response.finish_reason)
                outcome.finish_reason = name.removeprefix("FINISH_REASON_").lower()
                outcome.prompt_tokens = response.usage.prompt_tokens
                outcome.cached_prompt_tokens = response.usage.cached_prompt_tokens
                outcome.error = response.error
    except grpc.aio.AioRpcError as exc:
        outcome.status = exc.code().name
        outcome.error = outcome.error or exc.details() or ""
    outcome.end_s = time.perf_counter() - t0


async def run_load(args: argparse.Namespace) -> list[Outcome]:
    """Fire every request (open or closed loop) and wait for all of them."""
    requests = build_requests(args)
    security = ClientSecurity.from_args(args)
    metadata = security.metadata()
    channels = [security.channel(args.target) for _ in range(args.channels)]
    stubs = [pb_grpc.GenerationServiceStub(c) for c in channels]
    rng = random.Random(args.seed + 1)
    limit = asyncio.Semaphore(args.concurrency) if args.concurrency else None
    try:
        for channel in channels:
            try:
                await asyncio.wait_for(channel.channel_ready(), timeout=args.connect_timeout)
            except TimeoutError:
                raise ConnectionError(
                    f"cannot connect to {args.target} within {args.connect_timeout:g} s "
                    "(is `pdserve serve` running there?)"
                ) from None
        t0 = time.perf_counter()

        async def guarded(i: int) -> None:
            request, outcome = requests[i]
            async with limit or contextlib.nullcontext():
                await run_one(stubs[i % len(stubs)], request, outcome, t0, args.timeout, metadata)

        tasks = []
        for i in range(len(requests)):
            tasks.append(asyncio.create_task(guarded(i)))
            if args.rate and math.isfinite(args.rate) and i + 1 < len(requests):
                # Poisson process: exponential gaps with mean 1/rate.
                await asyncio.sleep(rng.expovariate(args.rate))
        await asyncio.gather(*tasks)
    finally:
        for channel in channels:
            await channel.close()
    return [outcome for _, outcome in requests]


def summarize(outcomes: list[Outcome], args: argparse.Namespace) -> dict[str, Any]:
    """Aggregate metrics; latencies in milliseconds, rates per second.

    Only completed requests (STOP or LENGTH) enter latencies, throughput and goodput; the
    duration runs from the first send to the end of the last request, whatever its end.
    """
    done = [o for o in outcomes if o.completed]
    failed = [o for o in outcomes if not o.completed]
    start = min((o.sent_s for o in outcomes), default=0.0)
    end = max((o.end_s for o in outcomes if o.end_s is not None), default=start)
    duration = max(end - start, 1e-9)
    ttfts = [o.ttft_s for o in done if o.ttft_s is not None]
    tpots = [o.tpot_s for o in done if o.tpot_s is not None]
    # One inter-token sample per gap between chunks (decode sends one chunk per step).
    itls = [b - a for o in done for a, b in zip(o.chunk_times_s, o.chunk_times_s[1:], strict=False)]
    latencies = [o.latency_s for o in done if o.latency_s is not None]

    def meets_slo(o: Outcome) -> bool:
        if args.ttft_slo is not None and (o.ttft_s is None or o.ttft_s > args.ttft_slo):
            return False
        # A one-token answer has no TPOT and so cannot miss that SLO.
        return args.tpot_slo is None or o.tpot_s is None or o.tpot_s <= args.tpot_slo

    # The cached share, from every final message's usage (an aborted request's prompt
    # was looked up in the cache too).
    finals = [o for o in outcomes if o.finish_reason]
    prompt_tokens_seen = sum(o.prompt_tokens for o in finals)
    cached = sum(o.cached_prompt_tokens for o in finals)
    output_tokens = sum(o.output_tokens for o in done)
    return {
        "num_requests": len(outcomes),
        "seed": args.seed,
        # The lengths asked for: uniform MIN:MAX ranges, exact when ignore_eos.
        "prompt_len": list(args.prompt_len),
        "output_len": list(args.output_len),
        "ignore_eos": not args.allow_eos,
        "num_completed": len(done),
        # Every ending, by reason: "stop"/"length" (completed), then finish reasons in
        # capitals ("ABORT", "ERROR") and gRPC status codes ("UNAVAILABLE").
        "outcomes": dict(sorted(Counter(o.outcome for o in outcomes).items())),
        "not_completed": dict(sorted(Counter(o.outcome for o in failed).items())),
        "duration_s": duration,
        "request_throughput": len(done) / duration,
        "output_token_throughput": output_tokens / duration,
        "total_output_tokens": output_tokens,
        "total_prompt_tokens": sum(o.prompt_tokens for o in done),
        "cached_prompt_tokens": cached,
        "cached_prompt_share": cached / prompt_tokens_seen if prompt_tokens_seen else math.nan,
        "goodput": sum(meets_slo(o) for o in done) / duration,
        # The SLOs goodput counts against; both None: goodput is the request throughput.
        "ttft_slo_s": args.ttft_slo,
        "tpot_slo_s": args.tpot_slo,
        "ttft_ms": distribution(ttfts, scale=1000),
        "tpot_ms": distribution(tpots, scale=1000),
        "itl_ms": distribution(itls, scale=1000),
        "e2e_latency_ms": distribution(latencies, scale=1000),
    }


def _lengths_line(summary: dict[str, Any]) -> str:
    (p_lo, p_hi), (o_lo, o_hi) = summary["prompt_len"], summary["output_len"]
    n = max(summary["num_completed"], 1)
    exact = "" if summary["ignore_eos"] else ", or less at end-of-text"
    return (
        f"lengths           prompt {p_lo}-{p_hi} tokens (mean "
        f"{summary['total_prompt_tokens'] / n:.0f}), output {o_lo}-{o_hi} tokens{exact} "
        f"(mean {summary['total_output_tokens'] / n:.0f})"
    )


def _goodput_note(summary: dict[str, Any]) -> str:
    """What goodput counted: the SLOs met, or that there were none."""
    slos = [
        f"{name} <= {summary[key] * 1000:g} ms"
        for name, key in (("TTFT", "ttft_slo_s"), ("TPOT", "tpot_slo_s"))
        if summary.get(key) is not None
    ]
    if not slos:
        return "(no --ttft-slo or --tpot-slo: every completed request, = request tput)"
    return "(completed with " + " and ".join(slos) + ")"


def format_table(summary: dict[str, Any]) -> str:
    """Human-readable report; every figure below the first lines counts completed requests."""
    failed = summary["not_completed"]
    requests = f"requests          {summary['num_completed']}/{summary['num_requests']} completed"
    if failed:
        requests += "; not completed: " + ", ".join(f"{k} {v}" for k, v in failed.items())
    share = summary["cached_prompt_share"]
    lines = [
        requests,
        _lengths_line(summary),
        f"prompts           seed {summary['seed']} (--seed {summary['seed']} sends them "
        f"again); {share:.1%} of prompt tokens were in the server's prefix cache",
        f"duration          {summary['duration_s']:.2f} s",
        f"request tput      {summary['request_throughput']:.2f} req/s",
        f"output tok tput   {summary['output_token_throughput']:.1f} tok/s",
        f"goodput           {summary['goodput']:.2f} req/s {_goodput_note(summary)}",
        "",
    ]
    metrics = (
        ("ttft_ms", "TTFT"),
        ("tpot_ms", "TPOT"),
        ("itl_ms", "ITL"),
        ("e2e_latency_ms", "E2E latency"),
    )
    rows = [
        [label, *(fmt(summary[key][q], 2) for q in ("mean", "p50", "p90", "p99"))]
        for key, label in metrics
    ]
    lines += text_table(["metric (ms)", "mean", "p50", "p90", "p99"], rows)
    return "\n".join(lines)


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module's docstring as written, and every option's default where it has one
    (not for switches, nor for options that are off unless given)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or isinstance(action.default, bool):
            return action.help
        return super()._get_help_string(action)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line of the load generator."""
    p = argparse.ArgumentParser(
        prog="python -m bench.load", description=__doc__, formatter_class=_HelpFormatter
    )
    p.add_argument("--target", default="127.0.0.1:50051", help="router HOST:PORT")
    p.add_argument("--num-requests", type=int, default=100, help="requests sent in all")
    p.add_argument("--rate", type=float, help="Poisson arrival rate, req/s (inf = all at once)")
    p.add_argument("--concurrency", type=int, help="max requests in flight (alone: closed loop)")
    p.add_argument("--prompt-len", type=parse_range, default="128:512", help="MIN:MAX tokens")
    p.add_argument("--output-len", type=parse_range, default="64:128", help="MIN:MAX tokens")
    p.add_argument(
        "--token-ids",
        type=parse_range,
        default="1000:30000",
        help="MIN:MAX range random prompt token ids are drawn from (MAX exclusive); "
        "stay inside the model's vocabulary and away from special tokens",
    )
    p.add_argument("--text-prompts", action="store_true", help="random words instead of ids")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument(
        "--allow-eos",
        action="store_true",
        help="let the model stop early (default: ignore_eos, so output lengths are exact)",
    )
    p.add_argument(
        "--ttft-slo",
        type=float,
        help="seconds, for goodput (without either SLO every completed request counts, and "
        "goodput equals request throughput)",
    )
    p.add_argument("--tpot-slo", type=float, help="seconds per output token, for goodput")
    p.add_argument("--timeout", type=float, default=120.0, help="per-request deadline, s")
    p.add_argument(
        "--connect-timeout", type=float, default=10.0, help="wait this long for the target, s"
    )
    p.add_argument("--channels", type=int, default=1, help="gRPC channels (connections)")
    p.add_argument(
        "--seed",
        type=int,
        help="prompts, lengths and arrival gaps from this seed (default: a fresh one per "
        "run, printed in the report, so a rerun does not meet the last run's prompts in the "
        "server's prefix cache)",
    )
    p.add_argument("--out", help="write summary and per-request records as JSON here")
    add_security_arguments(p)
    args = p.parse_args(argv)
    if args.rate is None and args.concurrency is None:
        p.error("give --rate, --concurrency, or both")
    if args.rate is not None and not args.rate > 0:
        p.error("--rate must be > 0")
    if args.concurrency is not None and args.concurrency < 1:
        p.error("--concurrency must be >= 1")
    if args.num_requests < 1 or args.channels < 1:
        p.error("--num-requests and --channels must be >= 1")
    if args.seed is None:
        args.seed = secrets.randbelow(2**31)
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print the table, optionally write JSON; exit 1 unless every
    request completed."""
    args = parse_args(argv)
    try:
        outcomes = asyncio.run(run_load(args))
    except ConnectionError as exc:
        print(f"bench.load: {exc}", file=sys.stderr)
        return 2
    summary = summarize(outcomes, args)
    print(format_table(summary))
    if args.out:
        config = {k: v for k, v in vars(args).items() if k != "out"}
        extra = ("outcome", "ttft_s", "tpot_s", "latency_s")
        requests = [{**asdict(o), **{k: getattr(o, k) for k in extra}} for o in outcomes]
        write_result(
            args.out, "bench.load", argv, config=config, summary=summary, requests=requests
        )
        print(f"wrote {args.out}", file=sys.stderr)
    return 0 if summary["num_completed"] == summary["num_requests"] else 1


if __name__ == "__main__":
    sys.exit(main())
