"""Multi-turn chat workload: prefix-cache hit rate under least-loaded vs prefix-aware
routing, against an oracle (one worker with an unbounded cache).

Sessions share a long system prompt; each turn's prompt is the system prompt, the
session's history (every earlier user message and answer) and a new user message.

The simulation runs the real routing code (router.routing.kv_index,
router.routing.cache_aware) over N real engine caches (engine.core KVCacheManager with a
bounded number of blocks, fed back to the index through KV events), with no model: hit
rates depend only on which prompt meets which cache, not on the hardware. Time is
simulated too: a prefill takes `prefill_s_per_token` per uncached prompt token, an
answer `decode_s_per_token` per token, and a user thinks `think_s` between turns.
`--pool prefill` models the prefill pool (a worker caches prompts only; answers are
decoded elsewhere), `--pool colocated` replicas that decode too (answers are cached
where they were generated).

    python -m bench.multiturn --sessions 64 --turns 6 --workers 4 --out multiturn.json

A live mode (sessions sent to a running router, reading `cached_prompt_tokens` and
TTFT from each final message) plugs in as another `Backend`.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import sys
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol

from bench.report import provenance
from engine.core.kv_cache_manager import KVCacheManager, cdiv
from router.routing.cache_aware import RoutingConfig, RoutingPolicy, choose_by_work, choose_worker
from router.routing.kv_index import PrefixIndex

Pool = Literal["prefill", "colocated"]


@dataclass(frozen=True)
class Workload:
    """Shape of the conversations."""

    num_sessions: int = 64
    num_turns: int = 6
    system_tokens: int = 1024
    user_tokens: int = 64
    answer_tokens: int = 128
    think_s: float = 2.0
    seed: int = 0

    @staticmethod
    def add_args(p: argparse.ArgumentParser, defaults: Workload | None = None) -> None:
        """The workload's command-line flags (defaults from `defaults`)."""
        d = defaults or Workload()
        p.add_argument("--sessions", type=int, default=d.num_sessions)
        p.add_argument("--turns", type=int, default=d.num_turns)
        p.add_argument("--system-tokens", type=int, default=d.system_tokens)
        p.add_argument("--user-tokens", type=int, default=d.user_tokens)
        p.add_argument("--answer-tokens", type=int, default=d.answer_tokens)
        p.add_argument("--think-s", type=float, default=d.think_s)
        p.add_argument("--seed", type=int, default=d.seed)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Workload:
        return cls(
            num_sessions=args.sessions,
            num_turns=args.turns,
            system_tokens=args.system_tokens,
            user_tokens=args.user_tokens,
            answer_tokens=args.answer_tokens,
            think_s=args.think_s,
            seed=args.seed,
        )


@dataclass(frozen=True)
class ClusterShape:
    """The simulated workers and their time model."""

    num_workers: int = 4
    num_blocks: int = 1024  # per worker
    block_size: int = 16
    pool: Pool = "prefill"
    prefill_s_per_token: float = 0.0005
    decode_s_per_token: float = 0.02


class Conversation:
    """One session's token streams: fixed user messages and (simulated) answers."""

    def __init__(self, session: int, system: list[int], wl: Workload, rng: random.Random):
        self.session = session
        self.system = system
        base = 10_000 + session * 1_000_000  # disjoint token ranges per session
        self.users = [
            [base + rng.randrange(900_000) for _ in range(wl.user_tokens)]
            for _ in range(wl.num_turns)
        ]
        self.answers = [
            [base + rng.randrange(900_000) for _ in range(wl.answer_tokens)]
            for _ in range(wl.num_turns)
        ]

    def prompt(self, turn: int) -> list[int]:
        tokens = list(self.system)
        for t in range(turn):
            tokens += self.users[t] + self.answers[t]
        return tokens + self.users[turn]


def make_conversations(wl: Workload) -> list[Conversation]:
    rng = random.Random(wl.seed)
    system = [rng.randrange(5_000) + 10 for _ in range(wl.system_tokens)]
    return [Conversation(s, system, wl, rng) for s in range(wl.num_sessions)]


@dataclass
class TurnResult:
    """One request's outcome, the same fields a live run reads from the final message."""

    session: int
    turn: int
    worker: int
    prompt_tokens: int
    cached_prompt_tokens: int
    predicted_cached_tokens: int  # what the router expected; -1 when it did not predict
    ttft_s: float


class Backend(Protocol):
    """Runs a whole workload and reports every turn (simulation or a live router)."""

    def run(self, conversations: Sequence[Conversation], wl: Workload) -> list[TurnResult]: ...


@dataclass(frozen=True)
class _LoadView:
    index: int
    alive: bool
    num_assigned: int
    num_blocks_free: int


@dataclass
class _Job:
    req_id: str
    conv: Conversation
    turn: int
    tokens: list[int]
    arrival: float
    predicted: int


@dataclass
class _SimWorker:
    kv: KVCacheManager
    in_flight: int = 0
    queue: deque[_Job] = field(default_factory=deque)
    queued_tokens: int = 0  # uncached prompt tokens routed here and not yet prefilled


class SimulatedCluster:
    """N engine caches behind the router's index and policy, in simulated time.

    `policy=None` is the oracle: one worker whose cache holds everything ever computed.
    """

    def __init__(self, shape: ClusterShape, policy: RoutingPolicy | None) -> None:
        self.shape = shape
        self.routing = RoutingConfig(policy=policy) if policy else None
        self.index = PrefixIndex(shape.block_size)
        self._events: list[tuple[float, int, str, tuple[Any, ...]]] = []
        self._seq = 0
        self.results: list[TurnResult] = []

    def run(self, conversations: Sequence[Conversation], wl: Workload) -> list[TurnResult]:
        shape = self.shape
        self.think_s = wl.think_s
        if self.routing is None:
            total = sum(len(c.prompt(wl.num_turns - 1)) + wl.answer_tokens for c in conversations)
            unbounded = KVCacheManager(cdiv(total, shape.block_size) + 64, shape.block_size)
            workers = [_SimWorker(unbounded)]
        else:
            workers = [
                _SimWorker(KVCacheManager(shape.num_blocks, shape.block_size))
                for _ in range(shape.num_workers)
            ]
        self.workers = workers
        rng = random.Random(wl.seed + 1)
        for conv in conversations:  # sessions start spread over one think time
            self._push(rng.uniform(0, wl.think_s), "arrive", (conv, 0))
        while self._events:
            now, _, kind, payload = heapq.heappop(self._events)
            if kind == "arrive":
                self._arrive(now, *payload)
            elif kind == "prefilled":
                self._prefilled(now, *payload)
            elif kind == "done":
                self._done(now, *payload)
        return self.results

    def _push(self, t: float, kind: str, payload: tuple[Any, ...]) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, payload))

    def _arrive(self, now: float, conv: Conversation, turn: int) -> None:
        tokens = conv.prompt(turn)
        hashes = self.index.hash_prompt(tokens)
        if self.routing is None:
            w, predicted = 0, -1  # no prediction
        else:
            views = [
                _LoadView(i, True, wk.in_flight + len(wk.queue), wk.kv.num_free_blocks)
                for i, wk in enumerate(self.workers)
            ]
            if self.shape.pool == "prefill":  # as the router places prompts on prefill workers
                queued = [wk.queued_tokens for wk in self.workers]
                choice = choose_by_work(
                    views, queued, self.index, hashes, len(tokens), self.routing
                )
            else:
                choice = choose_worker(views, self.index, hashes, self.routing)
            assert choice is not None
            w, predicted = choice.index, choice.num_cached_tokens
            self.workers[w].queued_tokens += len(tokens) - predicted
        job = _Job(f"s{conv.session}t{turn}", conv, turn, tokens, now, predicted)
        self.workers[w].queue.append(job)
        self._admit(now, w)

    def _admit(self, now: float, w: int) -> None:
        wk = self.workers[w]
        while wk.queue:
            job = wk.queue[0]
            prefix = wk.kv.find_cached_prefix(job.tokens)
            hit = len(prefix) * wk.kv.block_size
            # Colocated replicas keep the blocks for the answer too.
            total = len(job.tokens) + self._answer_len(job)
            if wk.kv.allocate_slots(job.req_id, hit, total - hit, prefix) is None:
                return  # waits for a running request to finish
            wk.queue.popleft()
            wk.in_flight += 1
            wk.kv.record_prefix_query(len(job.tokens), hit)
            ttft = now - job.arrival + (len(job.tokens) - hit) * self.shape.prefill_s_per_token
            self.results.append(
                TurnResult(job.conv.session, job.turn, w, len(job.tokens), hit, job.predicted, ttft)
            )
            self._push(job.arrival + ttft, "prefilled", (w, job))

    def _answer_len(self, job: _Job) -> int:
        return len(job.conv.answers[job.turn]) if self.shape.pool == "colocated" else 0

    def _prefilled(self, now: float, w: int, job: _Job) -> None:
        wk = self.workers[w]
        if self.routing is not None:
            wk.queued_tokens -= len(job.tokens) - job.predicted
        wk.kv.cache_full_blocks(job.req_id, job.tokens, len(job.tokens))
        self._drain(w)
        decode_s = len(job.conv.answers[job.turn]) * self.shape.decode_s_per_token
        if self.shape.pool == "prefill":
            self._finish(now, w, job)  # the answer is decoded on another pool
            self._push(now + decode_s, "done", (None, job))
        else:
            self._push(now + decode_s, "done", (w, job))

    def _done(self, now: float, w: int | None, job: _Job) -> None:
        if w is not None:
            full = job.tokens + job.conv.answers[job.turn]
            self.workers[w].kv.cache_full_blocks(job.req_id, full, len(full))
            self._finish(now, w, job)
        if job.turn + 1 < len(job.conv.users):
            think = random.Random(job.req_id).uniform(0.5, 1.5) * self.think_s
            self._push(now + think, "arrive", (job.conv, job.turn + 1))

    def _finish(self, now: float, w: int, job: _Job) -> None:
        wk = self.workers[w]
        wk.kv.free(job.req_id)
        wk.in_flight -= 1
        self._drain(w)
        self._admit(now, w)

    def _drain(self, w: int) -> None:
        events = self.workers[w].kv.take_kv_events()
        if self.routing is not None:
            self.index.apply(w, events)


@dataclass(frozen=True)
class Summary:
    """Per-policy totals over every turn."""

    policy: str
    requests: int
    prompt_tokens: int
    cached_prompt_tokens: int
    hit_rate: float
    vs_oracle: float
    # Share of requests whose predicted hit equalled the engine's (None: nothing predicted).
    prediction_exact: float | None
    requests_per_worker: tuple[int, ...]


def summarize(policy: str, results: Sequence[TurnResult], oracle_rate: float) -> Summary:
    prompt = sum(r.prompt_tokens for r in results)
    cached = sum(r.cached_prompt_tokens for r in results)
    rate = cached / prompt if prompt else 0.0
    per_worker: dict[int, int] = {}
    for r in results:
        per_worker[r.worker] = per_worker.get(r.worker, 0) + 1
    predicted = [r for r in results if r.predicted_cached_tokens >= 0]
    exact = sum(r.predicted_cached_tokens == r.cached_prompt_tokens for r in predicted)
    return Summary(
        policy=policy,
        requests=len(results),
        prompt_tokens=prompt,
        cached_prompt_tokens=cached,
        hit_rate=rate,
        vs_oracle=rate / oracle_rate if oracle_rate else 0.0,
        prediction_exact=exact / len(predicted) if predicted else None,
        requests_per_worker=tuple(per_worker[w] for w in sorted(per_worker)),
    )


def run_simulation(wl: Workload, shape: ClusterShape) -> list[Summary]:
    """Oracle, least-loaded and prefix-aware over the same conversations."""
    conversations = make_conversations(wl)
    oracle = SimulatedCluster(shape, None).run(conversations, wl)
    oracle_rate = summarize("oracle", oracle, 1.0).hit_rate
    out = [summarize("oracle", oracle, oracle_rate)]
    for policy in ("least-loaded", "prefix-aware"):
        results = SimulatedCluster(shape, policy).run(conversations, wl)  # type: ignore[arg-type]
        out.append(summarize(policy, results, oracle_rate))
    return out


def format_table(summaries: Sequence[Summary]) -> str:
    lines = [
        f"{'policy':<14} {'requests':>8} {'prompt tok':>11} {'cached tok':>11} "
        f"{'hit rate':>8} {'vs oracle':>9} {'pred exact':>10}  requests/worker"
    ]
    for s in summaries:
        exact = "-" if s.prediction_exact is None else f"{s.prediction_exact:.1%}"
        lines.append(
            f"{s.policy:<14} {s.requests:>8} {s.prompt_tokens:>11} {s.cached_prompt_tokens:>11} "
            f"{s.hit_rate:>8.1%} {s.vs_oracle:>9.1%} {exact:>10}  "
            f"{list(s.requests_per_worker)}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    Workload.add_args(p)
    p.add_argument("--workers", type=int, default=ClusterShape.num_workers)
    p.add_argument("--blocks-per-worker", type=int, default=ClusterShape.num_blocks)
    p.add_argument("--block-size", type=int, default=ClusterShape.block_size)
    p.add_argument("--pool", choices=("prefill", "colocated"), default=ClusterShape.pool)
    p.add_argument("--out", help="write the summaries and settings as JSON here")
    args = p.parse_args(argv)
    wl = Workload.from_args(args)
    shape = ClusterShape(
        num_workers=args.workers,
        num_blocks=args.blocks_per_worker,
        block_size=args.block_size,
        pool=args.pool,
    )
    summaries = run_simulation(wl, shape)
    print(format_table(summaries))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "provenance": provenance(
                        "bench.multiturn", sys.argv[1:] if argv is None else argv
                    ),
                    "workload": asdict(wl),
                    "cluster": asdict(shape),
                    "results": [asdict(s) for s in summaries],
                },
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
