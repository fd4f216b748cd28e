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
from pathlib import Path

from bench.report import write_result
from bench.tree_ab import THIS_TREE, keep_minimum, measure_in


def measure(requests: int, steps: int, polls: int) -> dict[str, float]:
    """Microseconds per poll: the worker's merge + pack + pickle, the router's unpickle,
    and the frame's bytes, for `steps` steps of `requests` requests' sampled tokens."""
    import pickle
    import time

    from engine.wire import TokenBatch, TokenUpdate, WorkerStats, coalesce

    updates = [
        TokenUpdate(f"cmpl-{i:032x}", (1000 + step,), None, 16, scheduled_at=100.0 + i)
        for step in range(steps)
        for i in range(requests)
    ]
    stats = WorkerStats("decode", 0, 8192, 4096, requests, 0, 0, 0)

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
    p.add_argument("--rounds", type=int, default=5, help="rounds per tree (minimum kept)")
    p.add_argument("--baseline-tree", type=Path, help="another checkout, measured in turn")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    ns = p.parse_args(argv)
    steps = [int(s) for s in ns.steps.split(",") if s.strip()]
    trees = {"this tree": THIS_TREE}
    if ns.baseline_tree is not None:
        trees["baseline"] = ns.baseline_tree.resolve()
    best: dict[str, dict[int, dict[str, float]]] = {name: {} for name in trees}
    for _ in range(ns.rounds):
        for name, tree in trees.items():
            for k in steps:
                got = measure_in(tree, measure, requests=ns.requests, steps=k, polls=ns.polls)
                keep_minimum(best[name].setdefault(k, {}), got)
    print(f"{ns.requests} requests a step")
    header = f"{'tree':<11}{'steps':>6}{'worker µs':>11}{'router µs':>11}{'bytes':>8}"
    print(f"{header}{'worker ÷ base':>15}")
    for k in steps:
        base = best.get("baseline", {}).get(k)
        for name in trees:
            r = best[name][k]
            ratio = f"{r['worker_us'] / base['worker_us']:.2f}" if base else "-"
            print(
                f"{name:<11}{k:>6}{r['worker_us']:>11.1f}{r['router_us']:>11.1f}"
                f"{r['bytes']:>8.0f}{ratio:>15}"
            )
    if ns.out is not None:
        write_result(
            ns.out,
            "bench.token_batch",
            argv,
            trees={name: str(tree) for name, tree in trees.items()},
            results={name: {str(k): r for k, r in rows.items()} for name, rows in best.items()},
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
