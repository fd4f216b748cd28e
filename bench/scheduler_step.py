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
from typing import Any

from bench.tree_ab import add_ab_args, best_of_rounds, print_ab_table, trees, write_ab_result


def measure(point: int, steps: int, prompt_len: int) -> dict[str, float]:
    """Microseconds per step of schedule() and update() at `point` running requests,
    async scheduling as on GPUs (a step's results are applied after the next launch)."""
    import time

    from engine.core.config import CacheConfig, SchedulerConfig
    from engine.core.engine_core import EngineCore
    from engine.sampling_params import SamplingParams
    from engine.wire import GenerationInput

    batch = point  # running requests

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
    return {
        "schedule_us": 1e6 * schedule_s / steps,
        "update_us": 1e6 * update_s / steps,
        "step_us": 1e6 * (schedule_s + update_s) / steps,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", default="32,128,256", help="running requests, comma-separated")
    p.add_argument("--steps", type=int, default=300, help="decode steps timed per round")
    p.add_argument("--prompt-len", type=int, default=512)
    add_ab_args(p)
    ns = p.parse_args(argv)
    batches = [int(b) for b in ns.batch.split(",") if b.strip()]
    named = trees(ns.baseline_tree)
    best = best_of_rounds(
        named, batches, ns.rounds, measure, steps=ns.steps, prompt_len=ns.prompt_len
    )
    columns = [
        ("schedule µs", "schedule_us", ".1f"),
        ("update µs", "update_us", ".1f"),
        ("step µs", "step_us", ".1f"),
    ]
    print_ab_table(named, best, "batch", columns, ratio_of="step_us")
    write_ab_result(ns.out, "bench.scheduler_step", argv, named, best)
    return 0


if __name__ == "__main__":
    sys.exit(main())
