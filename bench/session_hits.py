"""Prefix-cache hits of multi-turn chat sessions against an oracle, per number of router
processes: does a follow-up find its session's cache whichever process it lands on?

A 2P1D service on the embedded model with `--local-prefill-max-tokens 0`, so that every
prompt runs on a prefill worker and the hits counted are the prefill pool's. Each round,
`--sessions` new sessions of `--turns` turns, `--concurrency` at a time: turn t+1's
messages are turn t's, its answer and a new question. Every turn opens a channel (a TCP
connection) of its own, so with several router processes a session's turns land on any
of them. A turn's oracle is what the worker that ran the session's previous turn holds of
its prompt: the previous prompt's full blocks, no more than the engine may reuse (all but
the prompt's last token); 0 for a first turn. Each session's system message is its own,
so sessions share no block. Per round: cached prompt tokens reported ÷ the oracle's.

A follow-up that finds less than its oracle was sent away from its cache (the routing
weighs a busy worker's queue against the tokens its cache saves). Whether that was the
faster choice shows in time to first token: each such turn's TTFT is set beside the
median TTFT of the round's follow-ups of the same turn number that found all of theirs
at home (which the routing sent there because that worker was not busy: a bar on the
low side). A round meets the target when cached ÷ oracle reaches it, or when every turn
sent away had its first token no later than that median.

    python -m bench.session_hits --router-processes 1,4 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc

from bench.harness.service import service_process
from bench.harness.streams import generate
from bench.report import int_list, text_table, write_result

DEFAULT_OUT = Path("bench/results/session_hits.json")
TOPICS = ["rivers", "bread", "comets", "bees", "glass", "chess", "tides", "salt", "owls"]
QUESTIONS = ["Tell me about {}.", "Why does that matter?", "Give one more fact about {}."]


@dataclass
class Turn:
    prompt_tokens: int
    cached: int
    oracle: int
    ttft_s: float = 0.0  # the service's time to first token for this turn


def oracle_tokens(prev_prompt_tokens: int | None, prompt_tokens: int, block_size: int) -> int:
    """Tokens a turn finds cached on the worker that holds its session's previous prompt."""
    if prev_prompt_tokens is None:
        return 0
    return min(prev_prompt_tokens // block_size, (prompt_tokens - 1) // block_size) * block_size


async def session(address: str, tag: str, topic: str, args: argparse.Namespace) -> list[Turn]:
    messages = [("system", f"Session {tag}. You are a helpful assistant; answer briefly.")]
    turns: list[Turn] = []
    prev: int | None = None
    for t in range(args.turns):
        messages.append(("user", QUESTIONS[t % len(QUESTIONS)].format(topic)))
        # A channel of its own: a new TCP connection, which the kernel hands to any process.
        options = [("grpc.use_local_subchannel_pool", 1)]
        async with grpc.aio.insecure_channel(address, options=options) as channel:
            result = await generate(
                channel, messages=messages, max_tokens=args.max_tokens, temperature=0.0
            )
        if result.final is None:
            raise RuntimeError(f"session {tag} turn {t + 1}: {result.outcome} {result.details}")
        usage = result.final.usage
        oracle = oracle_tokens(prev, usage.prompt_tokens, args.block_size)
        ttft_s = result.final.timings.time_to_first_token_seconds
        turns.append(Turn(usage.prompt_tokens, usage.cached_prompt_tokens, oracle, ttft_s))
        prev = usage.prompt_tokens
        messages.append(("assistant", result.text))
    return turns


async def run_round(address: str, r: int, args: argparse.Namespace) -> list[list[Turn]]:
    """Per session of round `r`, its turns."""
    limit = asyncio.Semaphore(args.concurrency)

    async def one(i: int) -> list[Turn]:
        async with limit:
            return await session(address, f"{r}-{i}", TOPICS[i % len(TOPICS)], args)

    return list(await asyncio.gather(*(one(i) for i in range(args.sessions))))


async def run_rounds(address: str, args: argparse.Namespace) -> list[list[list[Turn]]]:
    return [await run_round(address, r, args) for r in range(args.rounds)]


def sent_away(sessions: list[list[Turn]]) -> list[dict[str, Any]]:
    """Each follow-up that found less than its oracle: its turn number, its TTFT, and the
    median TTFT of the same turn number's follow-ups that found all of theirs (None
    when none did)."""
    away = []
    for t in range(1, max((len(s) for s in sessions), default=0)):
        nth = [s[t] for s in sessions if len(s) > t]
        home = [x.ttft_s for x in nth if x.cached >= x.oracle]
        bar = statistics.median(home) if home else None
        away += [
            {"turn": t + 1, "ttft_s": x.ttft_s, "home_ttft_p50_s": bar}
            for x in nth
            if x.cached < x.oracle
        ]
    return away


def summarize(n: int, r: int, sessions: list[list[Turn]]) -> dict[str, Any]:
    turns = [t for s in sessions for t in s]
    cached, oracle = sum(t.cached for t in turns), sum(t.oracle for t in turns)
    away = sent_away(sessions)
    return {
        "router_processes": n,
        "round": r + 1,
        "turns": len(turns),
        "cached_tokens": cached,
        "oracle_tokens": oracle,
        "hit_ratio": cached / oracle if oracle else float("nan"),
        "turns_below_oracle": sum(t.cached < t.oracle for t in turns),
        "first_turns_cached": sum(s[0].cached for s in sessions),
        "sent_away": away,
        # Every turn sent away from its cache had its first token no later than the
        # same turn number's at home (vacuously so when none was sent away).
        "away_no_slower": all(
            a["home_ttft_p50_s"] is not None and a["ttft_s"] <= a["home_ttft_p50_s"] for a in away
        ),
        "sessions": [[asdict(t) for t in s] for s in sessions],
    }


def away_cell(away: list[dict[str, Any]]) -> str:
    """`turn 3: 210 vs 260` per turn sent away (its TTFT against the home median)."""
    cells = []
    for a in away:
        bar = a["home_ttft_p50_s"]
        home = "-" if bar is None else f"{1e3 * bar:.0f}"
        cells.append(f"turn {a['turn']}: {1e3 * a['ttft_s']:.0f} vs {home}")
    return "; ".join(cells) or "-"


def serve_args(n: int, args: argparse.Namespace) -> list[str]:
    return [
        "--prefill-workers", "2", "--decode-workers", "1", "--router-processes", str(n),
        "--local-prefill-max-tokens", "0", "--block-size", str(args.block_size),
        *shlex.split(args.serve_args),
    ]  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.session_hits", description=__doc__.split("\n")[0]
    )
    p.add_argument("--router-processes", type=int_list, default=[1, 4], help="e.g. 1,4")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sessions", type=int, default=12, help="new sessions a round")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=4, help="sessions at a time")
    p.add_argument("--max-tokens", type=int, default=48, help="an answer's length at most")
    p.add_argument("--block-size", type=int, default=16, help="serve's --block-size")
    p.add_argument("--target", type=float, default=0.95, help="cached ÷ oracle, every round")
    p.add_argument("--serve-args", default="", help="more `pdserve serve` flags")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = []
    for n in args.router_processes:
        log = Path(tempfile.mkstemp(prefix=f"session-hits-{n}-", suffix=".log")[1])
        print(f"--router-processes {n}: service log {log}", flush=True)
        with service_process(serve_args(n, args), log) as svc:
            svc.wait_serving(900)
            rounds = asyncio.run(run_rounds(svc.address, args))
        results += [summarize(n, r, sessions) for r, sessions in enumerate(rounds)]
    keys = ["router_processes", "round", "turns", "cached_tokens", "oracle_tokens"]
    rows = [
        [
            *(s[k] for k in keys),
            f"{s['hit_ratio']:.3f}",
            s["turns_below_oracle"],
            away_cell(s["sent_away"]),
        ]
        for s in results
    ]
    header = ["router processes", "round", "turns", "cached", "oracle", "cached/oracle", "below"]
    header.append("sent away: TTFT ms vs home p50")
    print("\n".join(text_table(header, rows, title="prefix-cache hits of follow-up turns")))
    missed = [s for s in results if not (s["hit_ratio"] >= args.target or s["away_no_slower"])]
    verdict = "missed" if missed else "met"
    print(
        f"target cached/oracle >= {args.target:g}, or no turn sent away from its cache "
        f"slower than at home, in every round: {verdict}"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(args.out, "bench.session_hits", argv, rounds=results, target=args.target)
    print(f"results: {args.out}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
