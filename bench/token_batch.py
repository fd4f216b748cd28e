"""A decode worker's poll, without a model: its updates of N running requests over one
or more steps merged per request (`coalesce`), packed into a `TokenBatch` and pickled as
the worker's call connection sends it, then unpickled as the router reads it.

This is the worker's event loop's work per poll, done while its engine thread waits
for the interpreter, and the router's per poll and decode worker.

    python -m bench.token_batch --requests 128 --steps 1,2
    python -m bench.token_batch --baseline-tree ../other-checkout   # same run, in turn

With `--baseline-tree`, both trees are measured in child processes in turn, `--rounds`
times each; each number is the minimum over the rounds.
"""

from __future__ import annotations

import argparse
import sys

from bench.tree_ab import add_ab_args, best_of_rounds, print_ab_table, trees, write_ab_result


def measure(point: int, requests: int, polls: int) -> dict[str, float]:
    """Microseconds per poll: the worker's merge + pack + pickle, the router's unpickle,
    and the frame's bytes, for `point` steps of `requests` requests' sampled tokens."""
    import pickle
    import time

    from engine.wire import PoolName, TokenBatch, TokenUpdate, WorkerStats, coalesce

    updates = [
        TokenUpdate(f"cmpl-{i:032x}", (1000 + step,), None, 16, scheduled_at=100.0 + i)
        for step in range(point)
        for i in range(requests)
    ]
    stats = WorkerStats(PoolName.DECODE, 0, 8192, 4096, requests, 0, 0, 0)

    def send() -> bytes:
        batch = TokenBatch(tuple(coalesce(list(updates))), (), stats)
        return pickle.dumps((1, True, batch), protocol=pickle.HIGHEST_PROTOCOL)

    frame = send()
    t0 = time.perf_counter()
    for _ in range(polls):
        send()
    t1 = time.perf_counter()
    for _ in range(polls):
        pickle.loads(frame)
    t2 = time.perf_counter()
    return {
        "worker_us": 1e6 * (t1 - t0) / polls,
        "router_us": 1e6 * (t2 - t1) / polls,
        "bytes": float(len(frame)),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, default=128, help="running requests")
    p.add_argument("--steps", default="1,2", help="steps a poll finds, comma-separated")
    p.add_argument("--polls", type=int, default=500, help="polls timed per round")
    add_ab_args(p)
    ns = p.parse_args(argv)
    steps = [int(s) for s in ns.steps.split(",") if s.strip()]
    named = trees(ns.baseline_tree)
    best = best_of_rounds(named, steps, ns.rounds, measure, requests=ns.requests, polls=ns.polls)
    print(f"{ns.requests} requests a step")
    columns = [
        ("worker µs", "worker_us", ".1f"),
        ("router µs", "router_us", ".1f"),
        ("bytes", "bytes", ".0f"),
    ]
    print_ab_table(named, best, "steps", columns, ratio_of="worker_us")
    write_ab_result(ns.out, "bench.token_batch", argv, named, best)
    return 0


if __name__ == "__main__":
    sys.exit(main())
