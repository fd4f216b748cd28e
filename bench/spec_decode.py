"""Speculative decoding on against off, in one run on one machine: output tok/s, acceptance.

The workload is copy-heavy, where prompt lookup pays: code to re-emit with type hints,
text to correct or summarise, records to rewrite. With a tokenizer (the embedded model)
the prompts are those texts in the chat template; without one (random-weight shapes)
they are random token runs repeated three times. Each concurrency level runs the same
requests with speculation off and on (greedy, EOS ignored, so both produce exactly
`--max-tokens` tokens per request, and the outputs must be identical), in groups of
`concurrency` started together. Reported per level: output tok/s of both and their
ratio, the acceptance rate (accepted ÷ proposed), the mean accepted length (tokens a
verifying step gave a request: accepted proposals + 1) and target forward passes per
output token.

`--step-timing` also times one target step at batch 1 from a context of
`--context` tokens: a plain decode step and a verifying step of 1 + k tokens.

    python -m bench.spec_decode --concurrency 1 --out bench/results/spec_decode.json
    python -m bench.spec_decode --model deploy/model_configs/llama-3.1-8b \\
        --load-format dummy --method draft_model --draft-model deploy/model_configs/llama-3.1-8b \\
        --concurrency 1 --step-timing --out bench/results/spec_decode_8b.json
    python -m bench.spec_decode --concurrency 128 --disable-by-batch-size 32

Not a test: timings depend on the machine and on whatever else shares it.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.report import provenance

DEFAULT_OUT = Path("bench/results/spec_decode.json")

_CODE = """class InventoryItem:
    def __init__(self, item_name, item_price, item_quantity):
        self.item_name = item_name
        self.item_price = item_price
        self.item_quantity = item_quantity

    def total_value(self):
        return self.item_price * self.item_quantity

    def restock(self, extra_quantity):
        self.item_quantity = self.item_quantity + extra_quantity
"""
_TEXT = (
    "The annual report shows that the company increased its revenue by twelve percent "
    "while keeping its operating costs stable. The board recommends a higher dividend, "
    "and the new factory in the north will open next spring. Customer satisfaction rose "
    "for the third year in a row, and the company plans to hire two hundred engineers."
)
_RECORDS = (
    "name: Alice Johnson, city: Boston, role: engineer\n"
    "name: Bob Martinez, city: Denver, role: designer\n"
    "name: Carol Nguyen, city: Seattle, role: manager\n"
)
TEXT_PROMPTS = [
    f"Add type hints to every method of this class and show the whole class:\n\n{_CODE}",
    f"Correct any mistakes in this paragraph and repeat it in full:\n\n{_TEXT}",
    f"Summarise this text in two sentences, reusing its wording:\n\n{_TEXT}",
    f"Rewrite these records as a JSON list with the same fields:\n\n{_RECORDS}",
    f"Rename the class to StockItem and show the whole class again:\n\n{_CODE}",
    f"Copy this paragraph, replacing 'company' with 'firm':\n\n{_TEXT}",
    f"Write these records as a Markdown table:\n\n{_RECORDS}",
    f"Add a docstring to each method and show the whole class:\n\n{_CODE}",
]


def prompts_for(llm: Any, num_requests: int, seed: int) -> list[list[int]]:
    """`num_requests` prompts (token ids), cycling through the copy-heavy texts."""
    if llm.tokenizer is not None:
        from engine.frontend.prompt import encode_prompt

        texts = [TEXT_PROMPTS[i % len(TEXT_PROMPTS)] for i in range(num_requests)]
        return [list(encode_prompt(llm.tokenizer, messages=[("user", t)])) for t in texts]
    rng = random.Random(seed)
    vocab = llm.spec.vocab_size
    out = []
    for _ in range(num_requests):
        run = [rng.randrange(100, vocab) for _ in range(64)]
        out.append(run * 3)
    return out


def count_target_steps(llm: Any) -> list[int]:
    """A counter of the target's forward passes (the runner's launches)."""
    counter = [0]
    launch = llm.runner.launch

    def counted(batch: Any, **kwargs: Any) -> Any:
        counter[0] += 1
        return launch(batch, **kwargs)

    llm.runner.launch = counted
    return counter


def run_level(
    systems: dict[str, Any], prompts: list[list[int]], max_tokens: int, concurrency: int
) -> dict[str, dict[str, Any]]:
    """The prompts in groups of `concurrency` started together, each group on every
    system in turn (so a change in the machine's load falls on both); per system its
    timings (wall and this process's CPU seconds) and counters."""
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    before = {name: (llm.core.stats(), llm._bench_steps[0]) for name, llm in systems.items()}
    outputs: dict[str, list[tuple[int, ...]]] = {name: [] for name in systems}
    wall = dict.fromkeys(systems, 0.0)
    cpu = dict.fromkeys(systems, 0.0)
    for i in range(0, len(prompts), concurrency):
        for name, llm in systems.items():
            wall0, cpu0 = time.perf_counter(), time.process_time()
            group = llm.generate(prompts[i : i + concurrency], params)
            wall[name] += time.perf_counter() - wall0
            cpu[name] += time.process_time() - cpu0
            outputs[name] += [o.token_ids for o in group]
    results = {}
    for name, llm in systems.items():
        stats, steps = llm.core.stats(), llm._bench_steps[0]
        drafts = stats.spec_draft_tokens - before[name][0].spec_draft_tokens
        accepted = stats.spec_accepted_tokens - before[name][0].spec_accepted_tokens
        verifications = stats.spec_verifications - before[name][0].spec_verifications
        num_tokens = sum(len(o) for o in outputs[name])
        results[name] = {
            "outputs": outputs[name],
            "output_tokens": num_tokens,
            "wall_s": round(wall[name], 4),
            "process_cpu_s": round(cpu[name], 4),
            "output_tok_s": round(num_tokens / wall[name], 3),
            "target_steps": steps - before[name][1],
            "draft_tokens": drafts,
            "accepted_tokens": accepted,
            "verifications": verifications,
            "acceptance_rate": round(accepted / drafts, 4) if drafts else None,
            "mean_accepted_length": (
                round(1 + accepted / verifications, 3) if verifications else None
            ),
        }
    return results


def step_times(llm: Any, context: int, k: int, reps: int) -> dict[str, float]:
    """Median ms of a plain decode step and of a verifying step (1 + k tokens), batch 1."""
    from engine.core.batch import Batch, ScheduledSeq
    from engine.sampling_params import GREEDY
    from engine.spec.speculation import PROPOSAL_TOKEN

    runner = llm.runner
    block_size = runner.block_size
    table = tuple(range(-(-(context + k + 1) // block_size)))
    prompt = tuple(100 + (i % 1000) for i in range(context))
    runner.execute(Batch((ScheduledSeq("t", prompt, 0, table, False, GREEDY, 0),), block_size))
    drafter, runner.drafter = runner.drafter, None  # the target's step alone
    plain = Batch((ScheduledSeq("t", (7,), context, table, True, GREEDY, 0),), block_size)
    verify = Batch(
        (ScheduledSeq("t", (7,) + (8,) * k, context, table, True, GREEDY, 0, k),),
        block_size,
        num_draft_tokens=k,
    )
    out = {}
    for name, batch in (("plain_decode_ms", plain), ("verify_ms", verify)):
        times = []
        for i in range(reps + 3):
            t0 = time.perf_counter()
            runner.execute(batch)
            if i >= 3:
                times.append(1000 * (time.perf_counter() - t0))
        out[name] = round(statistics.median(times), 4)
    runner.drafter = drafter
    if drafter is not None:
        proposing = verify.seqs[0]._replace(token_ids=(7,) + (PROPOSAL_TOKEN,) * k)
        times = []
        for i in range(reps + 3):
            t0 = time.perf_counter()
            drafter.propose(Batch((proposing,), block_size, num_draft_tokens=k))
            if i >= 3:
                times.append(1000 * (time.perf_counter() - t0))
        out["draft_proposals_ms"] = round(statistics.median(times), 4)
    out["verify_over_plain"] = round(out["verify_ms"] / out["plain_decode_ms"], 3)
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model folder (default: the embedded SmolLM2-135M)")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype")
    p.add_argument("--method", default="ngram", choices=["ngram", "draft_model"])
    p.add_argument("--draft-model", help="draft model folder (method draft_model)")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--disable-by-batch-size", type=int)
    p.add_argument("--concurrency", default="1", help="comma-separated levels, e.g. 1,128")
    p.add_argument("--num-requests", type=int, help="per level (default: max(8, concurrency))")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument(
        "--kv-cache-gib",
        type=float,
        help="each engine's KV cache (default: 8 on CUDA, 0.5 on CPU; two engines share the "
        "device)",
    )
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--step-timing", action="store_true")
    p.add_argument(
        "--no-compile",
        action="store_true",
        help="CUDA: no torch.compile (CUDA graphs stay; a faster start for large shapes)",
    )
    p.add_argument("--context", type=int, default=2048, help="--step-timing's context")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p.parse_args(argv)


def build(ns: argparse.Namespace, speculative: Any) -> Any:
    from engine.core.config import SchedulerConfig
    from engine.factory import EngineArgs
    from engine.llm import LLM

    args = EngineArgs(model=ns.model, device=ns.device)
    kv_cache_gib = ns.kv_cache_gib or (8.0 if args.resolve_device().type == "cuda" else 0.5)
    llm = LLM(
        EngineArgs(
            model=ns.model,
            load_format=ns.load_format,
            device=ns.device,
            dtype=ns.dtype,
            kv_cache_gib=kv_cache_gib,
            scheduler=SchedulerConfig(max_num_seqs=ns.max_num_seqs),
            speculative=speculative,
            compile_model=not ns.no_compile,
        )
    )
    llm._bench_steps = count_target_steps(llm)  # type: ignore[attr-defined]
    return llm


def main(argv: list[str] | None = None) -> int:
    from engine.spec.spec_config import SpeculativeConfig

    ns = parse_args(argv)
    spec = SpeculativeConfig(
        ns.method,
        ns.num_speculative_tokens,
        prompt_lookup_min=ns.prompt_lookup_min if ns.method == "ngram" else None,
        prompt_lookup_max=ns.prompt_lookup_max if ns.method == "ngram" else None,
        model=ns.draft_model,
        disable_by_batch_size=ns.disable_by_batch_size,
    )
    levels = [int(c) for c in ns.concurrency.split(",")]
    results: dict[str, Any] = {"config": vars(ns) | {"out": str(ns.out)}, "levels": []}
    systems = {"off": build(ns, None), "on": build(ns, spec)}
    prompts_all = prompts_for(systems["off"], max(max(levels), 8), ns.seed)
    run_level(systems, prompts_all[:1], 4, 1)  # warm-up: first-call costs are no one's
    print(
        f"{'conc':>5} {'off tok/s':>10} {'on tok/s':>10} {'ratio':>6} {'cpu ratio':>9} "
        f"{'accept':>7} {'mean len':>8} {'steps/tok on':>12} {'same':>5}"
    )
    for conc in levels:
        n = ns.num_requests or max(8, conc)
        prompts = [prompts_all[i % len(prompts_all)] for i in range(n)]
        measured = run_level(systems, prompts, ns.max_tokens, conc)
        off, on = measured["off"], measured["on"]
        same = off.pop("outputs") == on.pop("outputs")
        ratio = on["output_tok_s"] / off["output_tok_s"]
        level = {
            "concurrency": conc,
            "requests": n,
            "off": off,
            "on": on,
            "speedup": round(ratio, 3),
            # The same over CPU seconds of this process: on a shared CPU it is less
            # sensitive to other processes than wall time (bench.offline does the same).
            "speedup_cpu_time": round(off["process_cpu_s"] / max(on["process_cpu_s"], 1e-9), 3),
            "identical_outputs": same,
        }
        results["levels"].append(level)
        steps_per_token = on["target_steps"] / max(on["output_tokens"], 1)
        print(
            f"{conc:>5} {off['output_tok_s']:>10.1f} {on['output_tok_s']:>10.1f} "
            f"{ratio:>6.2f} {level['speedup_cpu_time']:>9.2f} {on['acceptance_rate'] or 0:>7.2f} "
            f"{on['mean_accepted_length'] or 0:>8.2f} {steps_per_token:>12.3f} {same!s:>5}"
        )
    if ns.step_timing:
        timing = step_times(systems["on"], ns.context, ns.num_speculative_tokens, 20)
        results["step_timing"] = timing
        print("step timing, batch 1, context", ns.context, timing)
    results["provenance"] = provenance("bench.spec_decode", argv or sys.argv[1:])
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps(results, indent=2))
    print(f"wrote {ns.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
