"""The engine's host work per decode step, without a model: the scheduler's schedule()
and update() for N running requests in decode, over a runner that answers at once.

On GPUs a small model's decode step is bound by this work, not by the device (the
profile in docs/benchmarks.md): each microsecond here is one of TPOT at batch N.

    python -m bench.scheduler_step --batch 32,128,256 --out sched.json
    python -m bench.scheduler_step --baseline-tree ../other-checkout   # same run, alternating

With `--baseline-tree`, both trees are measured in child processes in turn, `--rounds`
times each, and the table shows both and their ratio. Each number is the minimum over
the rounds: a shared host's noise only ever adds time.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from bench.report import write_result
from bench.tree_ab import THIS_TREE, keep_minimum, measure_in


def measure(batch: int, steps: int, prompt_len: int) -> dict[str, float]:
    """Microseconds per step of schedule() and update() at `batch` running requests,
    async scheduling as on GPUs (a step's results are applied after the next launch)."""
    import time

    from engine.core.config import CacheConfig, SchedulerConfig
    from engine.core.engine_core import EngineCore
    from engine.sampling_params import SamplingParams
    from engine.wire import GenerationInput

    class Answered:
        def __init__(self, tokens: dict[str, int]) -> None:
            self.tokens = tokens

        def result(self) -> dict[str, int]:
            return self.tokens

    class InstantRunner:
        def launch(self, batch: Any) -> Answered:
            return Answered({s.req_id: 5 for s in batch.seqs if s.sample})

        def execute(self, batch: Any) -> dict[str, int]:
            return self.launch(batch).result()

    warm_up = 20
    max_tokens = steps + warm_up + 8
    core = EngineCore(
        InstantRunner(),  # type: ignore[arg-type]
        SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=max(8192, batch)),
        CacheConfig(num_blocks=batch * -(-(prompt_len + max_tokens) // 16) + 16),
        max_model_len=prompt_len + max_tokens + 16,
        vocab_size=32000,
        async_scheduling=True,
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        prompt = tuple((7 + i + j) % 32000 for j in range(prompt_len))
        core.add_request(GenerationInput(f"r{i}", prompt, params))
    sched, runner = core.scheduler, InstantRunner()  # stateless: answers as the core's
    in_flight = None
    schedule_s = update_s = 0.0
    for step in range(warm_up + steps):
        if step == warm_up:
            schedule_s = update_s = 0.0
        t0 = time.perf_counter()
        scheduled = sched.schedule()
        t1 = time.perf_counter()
        launched = runner.launch(scheduled)
        if in_flight is not None:
            t2 = time.perf_counter()
            sched.update(in_flight[0], in_flight[1].result())
            update_s += time.perf_counter() - t2
        schedule_s += t1 - t0
        in_flight = (scheduled, launched)
    return {"schedule_us": 1e6 * schedule_s / steps, "update_us": 1e6 * update_s / steps}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", default="32,128,256", help="running requests, comma-separated")
    p.add_argument("--steps", type=int, default=300, help="decode steps timed per round")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--rounds", type=int, default=5, help="rounds per tree (minimum kept)")
    p.add_argument("--baseline-tree", type=Path, help="another checkout, measured in turn")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    ns = p.parse_args(argv)
    batches = [int(b) for b in ns.batch.split(",") if b.strip()]
    trees = {"this tree": THIS_TREE}
    if ns.baseline_tree is not None:
        trees["baseline"] = ns.baseline_tree.resolve()
    best: dict[str, dict[int, dict[str, float]]] = {name: {} for name in trees}
    for _ in range(ns.rounds):
        for name, tree in trees.items():
            for b in batches:
                got = measure_in(tree, measure, batch=b, steps=ns.steps, prompt_len=ns.prompt_len)
                keep_minimum(best[name].setdefault(b, {}), got)
    print(
        f"{'tree':<11}{'batch':>6}{'schedule µs':>13}{'update µs':>11}{'step µs':>9}{'÷ base':>8}"
    )
    for b in batches:
        base = best.get("baseline", {}).get(b)
        for name in trees:
            r = best[name][b]
            r["step_us"] = r["schedule_us"] + r["update_us"]
            ratio = (
                f"{r['step_us'] / (base['schedule_us'] + base['update_us']):.2f}" if base else "-"
            )
            print(
                f"{name:<11}{b:>6}{r['schedule_us']:>13.1f}{r['update_us']:>11.1f}"
                f"{r['step_us']:>9.1f}{ratio:>8}"
            )
    if ns.out is not None:
        write_result(
            ns.out,
            "bench.scheduler_step",
            argv,
            trees={name: str(tree) for name, tree in trees.items()},
            results={name: {str(b): r for b, r in rows.items()} for name, rows in best.items()},
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
