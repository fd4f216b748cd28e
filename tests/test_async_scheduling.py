"""Scheduling one step ahead (async scheduling) on a fake runner: the engine launches step
N+1 before it applies step N, and callers must not be able to tell, except by speed."""

from __future__ import annotations

from pathlib import Path
from typing import Unpack

import pytest

from engine.core.config import CacheConfig, SchedulerConfig
from engine.core.engine_core import EngineCore
from engine.core.request import PLACEHOLDER_TOKEN, FinishReason
from engine.core.waiting_queue import QueuePolicy
from engine.sampling_params import SamplingParams
from engine.wire import GenerationInput, TokenUpdate
from tests.fakes import (
    FakeRunner,
    SchedulerFields,
    assert_engine_empty,
    expected_output,
    make_engine,
)

PROMPT = (5, 6, 7)
EXPECTED = expected_output(list(PROMPT), 8)


def make_core(
    async_scheduling: bool,
    *,
    num_blocks: int = 64,
    eos: frozenset[int] = frozenset(),
    handoff: bool = False,
    **sched: Unpack[SchedulerFields],
) -> tuple[EngineCore, FakeRunner]:
    return make_engine(
        num_blocks, 4, eos=eos, handoff=handoff, async_scheduling=async_scheduling, **sched
    )


def run(core: EngineCore) -> list[TokenUpdate]:
    updates: list[TokenUpdate] = []
    for _ in range(1000):
        if not core.has_unfinished:
            return updates
        updates.extend(core.step())
    raise AssertionError("engine did not finish")


def collect(updates: list[TokenUpdate]) -> tuple[dict[str, list[int]], dict[str, FinishReason]]:
    tokens: dict[str, list[int]] = {}
    finishes: dict[str, FinishReason] = {}
    for upd in updates:
        assert upd.req_id not in finishes, "an update after the terminal one"
        assert PLACEHOLDER_TOKEN not in upd.new_token_ids
        tokens.setdefault(upd.req_id, []).extend(upd.new_token_ids)
        if upd.finish_reason is not None:
            finishes[upd.req_id] = upd.finish_reason
    return tokens, finishes


def add_mix(core: EngineCore) -> None:
    core.add_request(GenerationInput("eos", PROMPT, SamplingParams(max_tokens=8)))
    stop = SamplingParams(max_tokens=8, ignore_eos=True, stop_token_ids=(EXPECTED[4],))
    core.add_request(GenerationInput("stop", PROMPT, stop))
    core.add_request(GenerationInput("len", PROMPT, SamplingParams(max_tokens=6, ignore_eos=True)))
    core.add_request(
        GenerationInput("long", tuple(range(20, 57)), SamplingParams(max_tokens=5, ignore_eos=True))
    )


def test_one_step_ahead_gives_the_same_tokens_and_finishes() -> None:
    results = []
    for async_scheduling in (False, True):
        core, _ = make_core(
            async_scheduling, eos=frozenset({EXPECTED[2]}), long_prefill_token_threshold=8
        )
        add_mix(core)
        results.append(collect(run(core)))
        assert_engine_empty(core)
    assert results[0] == results[1]
    tokens, finishes = results[1]
    assert tokens["eos"] == EXPECTED[:3]
    assert tokens["stop"] == EXPECTED[:5]
    assert finishes == {
        "eos": FinishReason.STOP,
        "stop": FinishReason.STOP,
        "len": FinishReason.LENGTH,
        "long": FinishReason.LENGTH,
    }


def test_the_next_step_is_launched_before_this_ones_tokens_are_known() -> None:
    core, runner = make_core(True)
    core.add_request(GenerationInput("r", PROMPT, SamplingParams(max_tokens=4, ignore_eos=True)))
    assert core.step() == []  # the prefill is launched; nothing is known yet
    updates = core.step()  # the first decode is launched, then the prefill's token arrives
    assert [u.new_token_ids for u in updates] == [(EXPECTED[0],)]
    decode = runner.batches[-1].seqs[0]
    assert decode.token_ids == (PLACEHOLDER_TOKEN,)  # fed on the device by the runner
    assert decode.start_position == len(PROMPT)


def test_a_length_stop_costs_no_extra_step_and_a_token_stop_costs_one() -> None:
    steps = {}
    for name, params in {
        "length": SamplingParams(max_tokens=4, ignore_eos=True),
        "token": SamplingParams(max_tokens=8, ignore_eos=True, stop_token_ids=(EXPECTED[3],)),
    }.items():
        core, runner = make_core(True)
        core.add_request(GenerationInput("r", PROMPT, params))
        tokens, _ = collect(run(core))
        assert tokens["r"] == EXPECTED[:4]
        steps[name] = len(runner.batches)
    # A prefill, then three decodes; the token stop is seen only after the fifth launched.
    assert steps == {"length": 4, "token": 5}


def test_an_abort_while_a_step_is_in_flight_ends_the_request_at_once() -> None:
    core, _ = make_core(True)
    core.add_request(GenerationInput("a", PROMPT, SamplingParams(max_tokens=50, ignore_eos=True)))
    core.add_request(GenerationInput("b", PROMPT, SamplingParams(max_tokens=5, ignore_eos=True)))
    updates = core.step() + core.step() + core.step()
    core.abort("a")  # "a" is in the step in flight
    updates += run(core)
    tokens, finishes = collect(updates)
    assert len(tokens["a"]) == 2  # nothing after the abort
    assert tokens["b"] == EXPECTED[:5]
    assert finishes == {"b": FinishReason.LENGTH}
    assert_engine_empty(core)


def test_an_id_reused_after_an_abort_is_not_given_the_old_steps_tokens() -> None:
    core, _ = make_core(True)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    core.add_request(GenerationInput("r", PROMPT, params))
    core.step()
    core.step()  # a decode of the first "r" is in flight
    core.abort("r")
    core.add_request(GenerationInput("r", (9, 9, 9, 9), params))
    tokens, finishes = collect(run(core))
    assert tokens["r"] == expected_output([9, 9, 9, 9], 3)
    assert finishes == {"r": FinishReason.LENGTH}


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preemption_with_a_token_in_flight_recomputes_the_same_output(policy: QueuePolicy) -> None:
    # 8 blocks of 4 tokens for three requests of 20 tokens: someone is preempted while
    # its next token is still being sampled; the recompute samples it again.
    core, _ = make_core(True, num_blocks=8, policy=policy)
    prompts = {f"r{i}": tuple(range(10 * i + 1, 10 * i + 7)) for i in range(3)}
    for req_id, prompt in prompts.items():
        core.add_request(
            GenerationInput(req_id, prompt, SamplingParams(max_tokens=14, ignore_eos=True))
        )
    reqs = dict(core.scheduler.requests)
    tokens, _ = collect(run(core))
    assert sum(r.num_preemptions for r in reqs.values()) > 0
    for req_id, prompt in prompts.items():
        assert tokens[req_id] == expected_output(list(prompt), 14)
    assert_engine_empty(core)


def test_a_prefill_engine_hands_off_after_the_first_token_without_a_wasted_step() -> None:
    core, runner = make_core(True, handoff=True)
    core.add_request(GenerationInput("r", PROMPT, SamplingParams(max_tokens=8)))
    updates = run(core)
    assert [(u.new_token_ids, u.hand_off) for u in updates] == [((EXPECTED[0],), True)]
    assert len(runner.batches) == 1
    assert core.block_ids("r")  # kept for the hand-off until released
    core.release("r")
    assert_engine_empty(core)


def test_a_runner_that_cannot_launch_is_refused() -> None:
    class ExecuteOnly:
        def execute(self, batch: object) -> dict[str, int]:
            return {}

    with pytest.raises(ValueError, match="launch"):
        EngineCore(
            ExecuteOnly(),
            SchedulerConfig(),
            CacheConfig(num_blocks=8),
            max_model_len=100,
            vocab_size=100,
            async_scheduling=True,
        )


def test_the_model_runner_gives_the_same_tokens_one_step_ahead(
    tiny_model_paths: dict[str, Path],
) -> None:
    """The real runner feeds placeholders from its own last step: seeded sampling, stop
    tokens, chunked prefill and preemption give exactly the tokens of the plain loop."""
    from engine.factory import EngineArgs
    from engine.llm import LLM

    prompts = [list(range(3 + i, 40 + 7 * i)) for i in range(6)]
    params = [
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.9, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=18, temperature=1.2, top_k=20, top_p=0.9, seed=3),
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=16, temperature=0.7, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=22, temperature=0.0, ignore_eos=True),
    ]

    def generate(async_scheduling: bool, params: list[SamplingParams]) -> tuple[list, int]:
        llm = LLM(
            EngineArgs(
                model=str(tiny_model_paths["llama"]),
                num_blocks=40,  # 320 slots for ~520 tokens: someone is preempted
                block_size=8,
                async_scheduling=async_scheduling,
                scheduler=SchedulerConfig(long_prefill_token_threshold=16),
            )
        )
        assert llm.core.async_scheduling is async_scheduling
        outs = llm.generate(prompts, params)
        assert_engine_empty(llm.core)
        return [(o.token_ids, o.finish_reason) for o in outs], llm.core.scheduler.num_preemptions

    plain, _ = generate(False, params)
    # A stop token in the middle of the first output: the step after it is dropped.
    stop_at = plain[0][0][10]
    params[0] = SamplingParams(
        max_tokens=24, temperature=0.0, ignore_eos=True, stop_token_ids=(stop_at,)
    )
    plain, _ = generate(False, params)
    ahead, preemptions = generate(True, params)
    assert ahead == plain
    assert preemptions > 0
    assert plain[0][1] is FinishReason.STOP
