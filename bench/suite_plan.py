"""Which closed-loop runs the suite's systems make, and their prompts, so that the engine
in-process (b) and the services (c, cc) measure exactly the same work.

A run is a closed loop at concurrency C over `rounds` × C prompts: C requests start at
once and each one that finishes is replaced by the next prompt, so at most C are in
flight. One round is a burst (all prefills, then the decode steps: a two-GPU pipeline
can do no better there than one engine); several rounds let the loop reach the steady
state in which a prompt's prefill overlaps other requests' decode steps. At concurrency
1 the rounds are sequential requests.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench.suite_common import make_prompts, workload_seed

# Below this concurrency a burst and a steady state hardly differ (a few prefills), so
# the default is one round there; from it on, four.
STEADY_FROM_CONCURRENCY = 32
DEFAULT_STEADY_ROUNDS = 4


@dataclass(frozen=True)
class RunSpec:
    """One closed-loop run: `concurrency` in flight, `rounds` × `concurrency` prompts."""

    concurrency: int
    rounds: int
    prompt_len: int

    def __post_init__(self) -> None:
        if self.concurrency < 1 or self.rounds < 1 or self.prompt_len < 1:
            raise ValueError(f"concurrency, rounds and prompt_len must be >= 1: {self}")

    @property
    def num_prompts(self) -> int:
        return self.concurrency * self.rounds

    @property
    def label(self) -> str:
        return f"c{self.concurrency} x{self.rounds} p{self.prompt_len}"


def rounds_for(concurrency: int, rounds: int | None, rounds_at_c1: int) -> int:
    """Rounds at one concurrency: `rounds_at_c1` at 1; else `rounds` when given, else
    the steady-state default from STEADY_FROM_CONCURRENCY on and one round below it."""
    if concurrency == 1:
        return rounds_at_c1
    if rounds is not None:
        return rounds
    return DEFAULT_STEADY_ROUNDS if concurrency >= STEADY_FROM_CONCURRENCY else 1


def plan_runs(
    concurrency: list[int],
    prompt_len: int,
    *,
    rounds: int | None,
    rounds_at_c1: int,
    burst: bool,
    ttft_lens: Sequence[int] = (),
) -> list[RunSpec]:
    """Every run, in order: per concurrency the burst (when `burst` and the steady run has
    more than one round) then the steady run; then one run at concurrency 1 per
    `ttft_lens` length not already covered."""
    specs: list[RunSpec] = []
    for c in concurrency:
        n = rounds_for(c, rounds, rounds_at_c1)
        if c > 1 and n > 1 and burst:
            specs.append(RunSpec(c, 1, prompt_len))
        specs.append(RunSpec(c, n, prompt_len))
    for length in ttft_lens:
        spec = RunSpec(1, rounds_at_c1, length)
        if spec not in specs:
            specs.append(spec)
    return specs


def prompts_for(shape: str, spec: RunSpec, vocab_size: int) -> list[list[int]]:
    """The run's prompts, the same for every system. A burst's prompts are those of the
    suite's earlier one-round runs; a run of several rounds draws a different set, so a
    burst that ran first on the same engine leaves nothing in its prefix cache for it."""
    length = spec.prompt_len
    seed = workload_seed(shape, spec.concurrency, length)
    if spec.concurrency == 1:
        return [make_prompts(1, length, vocab_size, seed + r)[0] for r in range(spec.rounds)]
    if spec.rounds == 1:
        return make_prompts(spec.concurrency, length, vocab_size, seed)
    return make_prompts(spec.num_prompts, length, vocab_size, seed ^ (0x5EED << spec.rounds))


def parse_ints(text: str) -> list[int]:
    """'512,2048' -> [512, 2048]."""
    return [int(x) for x in text.split(",") if x.strip()]


def add_run_args(p: argparse.ArgumentParser, systems: str, ttft_lens: str) -> None:
    """The flags that shape the runs and the engine under them, for bench.gpu_suite and
    bench.suite_offline (`systems`: the parts they apply to)."""
    p.add_argument(
        "--rounds",
        type=int,
        help=f"{systems}: closed loop over ROUNDS x C prompts at each concurrency C > 1 "
        f"(default: {DEFAULT_STEADY_ROUNDS} from C = {STEADY_FROM_CONCURRENCY} on, 1 below; "
        "1 = a burst only)",
    )
    p.add_argument(
        "--burst",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=f"{systems}: also one round (a burst) where the closed loop has several",
    )
    p.add_argument(
        "--ttft-lens",
        default=ttft_lens,
        help=f"{systems}: prompt lengths also run alone (concurrency 1), for the TTFT table",
    )
    p.add_argument(
        "--prompt-graph-max-tokens",
        type=int,
        help=f"{systems}: the longest lone prompt chunk replayed from a CUDA graph "
        "(0 = every prompt eagerly; default: the engine's own)",
    )
    p.add_argument(
        "--no-compile",
        action="store_true",
        help=f"{systems} without torch.compile (8B shapes then start in about a minute "
        "instead of several on a fresh machine; compare runs of one setting only)",
    )


def plan_from_args(ns: Any) -> list[RunSpec]:
    """`plan_runs` from the suite's flags (gpu_suite and suite_offline share them)."""
    return plan_runs(
        ns.concurrency,
        ns.prompt_len,
        rounds=ns.rounds,
        rounds_at_c1=ns.rounds_at_c1,
        burst=ns.burst,
        ttft_lens=ns.ttft_lens,
    )
