"""An engine's speed, measured as it warms up: one prompt's pass and one decode step.

The router decides where a prompt runs from each worker's rates (router/routing/prefill_policy.py);
until traffic has measured them it has none, and a burst on a freshly started service is
exactly when the decision matters. So each worker times its own engine before it reports
itself started, and the router starts from that.

The passes run on the runner directly, not through the scheduler: no block is allocated
and nothing enters the prefix cache, so the engine starts as empty as it would without
them. Their K/V land in blocks no request holds yet (every block is free before the
first request), which the first request to take them overwrites.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.core.batch import Batch, plain_seq
from engine.core.config import SchedulerConfig
from engine.core.role import EngineRole
from engine.sampling_params import GREEDY
from engine.wire import EngineSpeed

if TYPE_CHECKING:
    from engine.model.model_runner import ModelRunner

WARM_UP_REQ_ID = "speed-warm-up"
# A prompt as long as a chat turn on a GPU, where a shorter one is launch-bound and would
# understate the rate; on a CPU the time grows with the tokens from a few dozen on (the
# embedded model's rate at 64 tokens is close to its rate at 512), so a short one keeps
# the warm-up within a few hundred ms.
PROMPT_TOKENS = {"cuda": 512}
CPU_PROMPT_TOKENS = 64
# Passes of each kind, the fastest kept: on a GPU the first eager pass may still pick or
# compile its kernels; a CPU pass has nothing to settle.
REPEATS = {"cuda": 2}
FIRST_TOKEN_ID = 100  # token ids from here on: ordinary text tokens in any vocabulary


@dataclass(frozen=True)
class WarmUpPlan:
    """How long a prompt the warm-up runs and how many times each pass is timed."""

    num_prompt_tokens: int
    repeats: int

    @classmethod
    def for_engine(cls, runner: ModelRunner, config: SchedulerConfig) -> WarmUpPlan:
        """The device's prompt length, within what one pass of this engine may run (its
        step budget, its chunk size) and what its cache and model length hold."""
        device_type = runner.device.type
        bounds = [
            PROMPT_TOKENS.get(device_type, CPU_PROMPT_TOKENS),
            config.step_tokens,
            runner.spec.max_model_len - 1,  # the decode step's token follows the prompt
            runner.num_blocks * runner.block_size - 1,
        ]
        if config.long_prefill_token_threshold:
            bounds.append(config.long_prefill_token_threshold)
        return cls(max(min(bounds), 1), REPEATS.get(device_type, 1))


def measure_speed(
    runner: ModelRunner,
    config: SchedulerConfig,
    role: EngineRole,
    plan: WarmUpPlan | None = None,
) -> EngineSpeed:
    """Time a prompt's pass (and, on an engine that decodes, a decode step after it) on
    the engine's runner, scheduled by `config`; call it before the engine loop starts."""
    plan = plan or WarmUpPlan.for_engine(runner, config)
    block_size = runner.block_size
    n = plan.num_prompt_tokens
    tokens = tuple((FIRST_TOKEN_ID + i) % runner.spec.vocab_size for i in range(n))
    table = tuple(range(-(-(n + 1) // block_size)))
    prompt = Batch((plain_seq(WARM_UP_REQ_ID, tokens, 0, table, True, GREEDY, 0),), block_size)
    step = Batch((plain_seq(WARM_UP_REQ_ID, tokens[:1], n, table, True, GREEDY, 0),), block_size)
    prefill_s = min(_timed(runner, prompt) for _ in range(plan.repeats))
    decode_step_s = None
    if role.decodes:
        decode_step_s = min(_timed(runner, step) for _ in range(plan.repeats))
    return EngineSpeed(n, prefill_s, decode_step_s)


def _timed(runner: ModelRunner, batch: Batch) -> float:
    """Seconds from launching the pass to its sampled tokens on the host."""
    start = time.perf_counter()
    runner.execute(batch)
    return time.perf_counter() - start
