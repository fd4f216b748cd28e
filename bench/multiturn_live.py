"""The multi-turn workload of bench.multiturn against real services: least-loaded against
prefix-aware routing, in the same run, with the oracle's hit rate beside them.

For each policy a fresh service starts (`pdserve serve --routing POLICY` plus
`--serve-args`; by default 2 prefill workers and 1 decode worker, every prompt through
the prefill pool), every session runs its turns with a think time between them, and
each final message gives `cached_prompt_tokens` and the client measures TTFT. The
oracle (one worker, unbounded cache) comes from the simulation over the same
conversations: it does not depend on the hardware. Prints a table; writes JSON.

    python -m bench.multiturn_live                                 # CPU, embedded model
    python -m bench.multiturn_live --sessions 64 --turns 6 --system-tokens 1024 \\
        --serve-args "--model deploy/model_configs/llama-3.2-1b --load-format dummy \\
        --prefill-workers 2" --answer-tokens 128                   # GPUs
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.harness import ServiceProcess
from bench.multiturn import (
    ClusterShape,
    Conversation,
    SimulatedCluster,
    TurnResult,
    Workload,
    make_conversations,
    summarize,
)
from bench.report import percentile, write_result
from router.cli.client import get_server_info, stream_generate

DEFAULT_SERVE_ARGS = (
    "--prefill-workers 2 --decode-workers 1 --prefill-kv-cache-gib 0.05 "
    "--decode-kv-cache-gib 0.1 --local-prefill-max-tokens 0"
)


def _in_vocab(token: int, vocab_size: int) -> int:
    """The workload's token ids are disjoint per session but unbounded: fold them into
    the model's vocabulary (a multiplicative hash keeps sessions apart in practice)."""
    return 100 + (token * 2654435761) % (vocab_size - 100)


class LiveRouter:
    """Runs the conversations against a router over gRPC, each session in turn order."""

    def __init__(self, address: str, vocab_size: int, think_s: float) -> None:
        self.address = address
        self.vocab_size = vocab_size
        self.think_s = think_s
        self.ttfts: list[float] = []
        self.output_tokens = 0

    def run(self, conversations: Sequence[Conversation], wl: Workload) -> list[TurnResult]:
        return asyncio.run(self._run(conversations, wl))

    async def _run(self, conversations: Sequence[Conversation], wl: Workload) -> list[TurnResult]:
        per_session = await asyncio.gather(*(self._session(c, wl) for c in conversations))
        return [r for results in per_session for r in results]

    async def _session(self, conv: Conversation, wl: Workload) -> list[TurnResult]:
        out = []
        for turn in range(wl.num_turns):
            prompt = [_in_vocab(t, self.vocab_size) for t in conv.prompt(turn)]
            start = time.perf_counter()
            ttft = None
            final = None
            async for resp in stream_generate(
                self.address,
                prompt_token_ids=prompt,
                max_tokens=wl.answer_tokens,
                temperature=0.0,
                ignore_eos=True,
            ):
                if ttft is None and resp.token_ids:
                    ttft = time.perf_counter() - start
                if resp.finish_reason:
                    final = resp
            assert final is not None and ttft is not None
            self.ttfts.append(ttft)
            self.output_tokens += final.usage.completion_tokens
            out.append(
                TurnResult(
                    session=conv.session,
                    turn=turn,
                    worker=-1,  # the final message does not name the worker
                    prompt_tokens=final.usage.prompt_tokens,
                    cached_prompt_tokens=final.usage.cached_prompt_tokens,
                    predicted_cached_tokens=-1,
                    ttft_s=ttft,
                )
            )
            await asyncio.sleep(self.think_s)
        return out


def run_policy(
    policy: str, args: argparse.Namespace, wl: Workload, log_dir: Path
) -> tuple[list[TurnResult], dict[str, Any]]:
    flags = [*shlex.split(args.serve_args), "--routing", policy]
    svc = ServiceProcess(flags, log_dir / f"service-{policy}.log")
    try:
        svc.wait_serving(900)
        info = asyncio.run(get_server_info(svc.address))
        vocab = args.vocab_size
        live = LiveRouter(svc.address, vocab, wl.think_s)
        start = time.perf_counter()
        results = live.run(make_conversations(wl), wl)
        wall = time.perf_counter() - start
        stats = {
            "model": info.model,
            "ttft_p50_ms": round(1e3 * percentile(live.ttfts, 50), 1),
            "ttft_p99_ms": round(1e3 * percentile(live.ttfts, 99), 1),
            "output_tok_s": round(live.output_tokens / wall, 1),
            "requests_s": round(len(results) / wall, 2),
        }
        return results, stats
    finally:
        svc.stop()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    # Smaller than the simulation's defaults: every turn here is a real request.
    Workload.add_args(
        p,
        Workload(
            num_sessions=8,
            num_turns=4,
            system_tokens=256,
            user_tokens=32,
            answer_tokens=8,
            think_s=0.5,
        ),
    )
    p.add_argument("--vocab-size", type=int, default=49152, help="the served model's")
    p.add_argument("--serve-args", default=DEFAULT_SERVE_ARGS)
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "multiturn_live.json"))
    args = p.parse_args(argv)
    wl = Workload.from_args(args)
    conversations = make_conversations(wl)
    # Oracle: one worker whose cache never evicts (answers are not cached: prefill pool).
    oracle_shape = ClusterShape(num_workers=1, num_blocks=1 << 20, pool="prefill")
    oracle = SimulatedCluster(oracle_shape, None).run(conversations, wl)
    oracle_rate = summarize("oracle", oracle, 1.0).hit_rate
    rows: list[dict[str, Any]] = [
        {"policy": "oracle (simulated)", "hit_rate": round(oracle_rate, 4), "vs_oracle": 1.0}
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for policy in ("least-loaded", "prefix-aware"):
            results, stats = run_policy(policy, args, wl, Path(tmp))
            s = summarize(policy, results, oracle_rate)
            rows.append(
                {
                    "policy": policy,
                    "hit_rate": round(s.hit_rate, 4),
                    "vs_oracle": round(s.vs_oracle, 4),
                    "requests": s.requests,
                    **stats,
                }
            )
    print(
        f"{'policy':<20} {'hit rate':>8} {'vs oracle':>9} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'out tok/s':>9}"
    )
    for r in rows:
        print(
            f"{r['policy']:<20} {r['hit_rate']:>8.1%} {r['vs_oracle']:>9.1%} "
            f"{r.get('ttft_p50_ms', '-'):>9} {r.get('ttft_p99_ms', '-'):>9} "
            f"{r.get('output_tok_s', '-'):>9}"
        )
    write_result(args.out, "bench.multiturn_live", argv, workload=asdict(wl), rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
