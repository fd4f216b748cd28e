"""A worker's warm-up measures its engine's speed and leaves the engine as it found it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.core.config import SchedulerConfig
from engine.core.role import EngineRole
from engine.factory import EngineArgs
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.worker.warm_up import CPU_PROMPT_TOKENS, FIRST_TOKEN_ID, WarmUpPlan, measure_speed


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(EngineArgs(kv_cache_gib=0.05))


def test_the_warm_up_times_a_prompt_and_a_step_and_leaves_no_trace(
    llm: LLM, reference_llm: LLM
) -> None:
    config = llm.core.scheduler.config
    speed = measure_speed(llm.runner, config, EngineRole.COLOCATED)
    assert speed.num_prompt_tokens == CPU_PROMPT_TOKENS
    assert speed.prefill_s > 0 and speed.prefill_tokens_per_s > 0
    assert speed.decode_step_s is not None and speed.decode_step_s > 0
    # No block held, nothing in the prefix cache: the same prompt as the warm-up's finds
    # none of it cached, and generates what an engine that never warmed up generates.
    assert llm.core.stats().num_blocks_in_use == 0
    events = llm.core.take_kv_events()
    assert not events.stored and not events.removed
    prompt = [FIRST_TOKEN_ID + i for i in range(CPU_PROMPT_TOKENS)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    (out,) = llm.generate([prompt], params)
    (expected,) = reference_llm.generate([prompt], params)
    assert out.num_cached_tokens == 0
    assert out.token_ids == expected.token_ids
    assert llm.core.stats().num_blocks_in_use == 0


def test_a_prefill_engine_times_no_decode_step(llm: LLM) -> None:
    plan = WarmUpPlan(num_prompt_tokens=8, repeats=1)
    speed = measure_speed(llm.runner, llm.core.scheduler.config, EngineRole.PREFILL, plan)
    assert speed.num_prompt_tokens == 8 and speed.decode_step_s is None


def test_the_warm_up_prompt_fits_one_pass_of_the_engine(llm: LLM) -> None:
    config = llm.core.scheduler.config
    assert WarmUpPlan.for_engine(llm.runner, config) == WarmUpPlan(CPU_PROMPT_TOKENS, 1)
    chunked = replace(config, long_prefill_token_threshold=16)
    assert WarmUpPlan.for_engine(llm.runner, chunked).num_prompt_tokens == 16
    small_budget = SchedulerConfig(max_num_batched_tokens=24)
    assert WarmUpPlan.for_engine(llm.runner, small_budget).num_prompt_tokens == 24
