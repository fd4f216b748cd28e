"""Scheduler and engine-core behaviour on a fake runner: budgets, chunks, preemption, aborts."""

from __future__ import annotations

from typing import Any

import pytest

from engine.core.config import CacheConfig, SchedulerConfig
from engine.core.engine_core import EngineCore
from engine.core.request import FinishReason
from engine.sampling_params import SamplingParams
from engine.wire import GenerationInput
from tests.fakes import FakeRunner, add, expected_output, make_engine, run_to_completion


def test_budget_splits_between_decodes_and_a_new_prompt() -> None:
    core, _ = make_engine(num_blocks=2048, max_num_batched_tokens=1024)
    for i in range(96):
        add(core, f"d{i}", 8, 100)
    core.step()  # 96 prompts of 8 tokens: all prefilled, each now decoding
    add(core, "long", 1800, 10)
    batch = core.scheduler.schedule()
    per_req = {s.req_id: s.num_tokens for s in batch.seqs}
    assert sum(v for k, v in per_req.items() if k != "long") == 96
    assert per_req["long"] == 928
    long_req = core.scheduler.requests["long"]
    assert long_req.num_tokens - long_req.num_computed_tokens - per_req["long"] == 872


def test_an_unset_step_budget_is_the_device_default() -> None:
    unset = SchedulerConfig()
    assert unset.for_device("cuda").max_num_batched_tokens == 8192
    assert unset.for_device("cpu").max_num_batched_tokens == 2048
    assert SchedulerConfig(max_num_batched_tokens=512).for_device("cuda").step_tokens == 512
    core, _ = make_engine(num_blocks=2048)  # no device: the 2048-token fallback
    add(core, "long", 5000, 1)
    assert core.scheduler.schedule().num_tokens == 2048


def test_long_prompt_runs_in_chunks_of_the_threshold() -> None:
    core, runner = make_engine(num_blocks=512, long_prefill_token_threshold=512)
    add(core, "r", 4000, 1)
    run_to_completion(core)
    chunks = [b.seqs[0].num_tokens for b in runner.batches]
    assert chunks == [512] * 7 + [416]
    assert [b.seqs[0].sample for b in runner.batches] == [False] * 7 + [True]


def test_continuous_batching_beats_static_batching_in_steps() -> None:
    core, runner = make_engine(max_num_seqs=3)
    for i, n in enumerate([20, 40, 15, 30, 10]):
        add(core, f"r{i}", 4, n)
    run_to_completion(core)
    assert len(runner.batches) == 45
    static_steps = max(20, 40, 15) + max(30, 10)
    assert static_steps == 70


def test_decodes_go_before_new_prefills_unless_prioritized() -> None:
    for prioritize, expected in ((False, {"a": 1, "b": 15}), (True, {"b": 16})):
        core, _ = make_engine(max_num_batched_tokens=16, prioritize_prefill=prioritize)
        add(core, "a", 16, 5)
        core.step()
        add(core, "b", 16, 5)
        batch = core.scheduler.schedule()
        assert {s.req_id: s.num_tokens for s in batch.seqs} == expected


def test_preemption_by_recompute_gives_identical_output() -> None:
    # 8 blocks of 4 tokens = 32 slots, three requests needing 20 each: they cannot
    # all fit, so someone is preempted and recomputed.
    core, _ = make_engine(num_blocks=8, block_size=4)
    for i in range(3):
        add(core, f"r{i}", 6, 14)
    reqs = dict(core.scheduler.requests)
    prompts = {req_id: r.prompt_token_ids[:] for req_id, r in reqs.items()}
    outputs = run_to_completion(core)
    assert sum(r.num_preemptions for r in reqs.values()) > 0
    for req_id, prompt in prompts.items():
        assert outputs[req_id] == expected_output(prompt, 14)
    assert core.scheduler.kv.num_blocks_in_use == 0


def test_preemption_victim_is_lowest_priority_latest_arrival() -> None:
    core, _ = make_engine(num_blocks=6, block_size=4, policy="priority")
    add(core, "important", 8, 12, priority=0)
    add(core, "minor", 8, 12, priority=5)
    preempted: set[str] = set()
    while core.has_unfinished:
        core.step()
        preempted |= {r.req_id for r in core.scheduler.waiting if r.num_preemptions}
    assert preempted == {"minor"}


def test_prefix_cache_hits_skip_shared_blocks() -> None:
    core, runner = make_engine(num_blocks=64, block_size=4)
    shared = tuple(range(10, 30))  # 20 tokens = 5 full blocks
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    core.add_request(GenerationInput("a", shared + (1, 2), sp))
    run_to_completion(core)
    core.add_request(GenerationInput("b", shared + (3, 4), sp))
    out = run_to_completion(core)
    first_chunk_b = [s for b in runner.batches for s in b.seqs if s.req_id == "b"][0]
    assert first_chunk_b.start_position == 20
    assert first_chunk_b.num_tokens == 2
    assert out["b"] == expected_output(list(shared + (3, 4)), 3)
    stats = core.scheduler.kv.stats
    assert stats.hit_tokens == 20
    assert core.scheduler.kv.num_blocks_in_use == 0


def test_abort_in_any_state_frees_blocks_and_is_idempotent() -> None:
    core, _ = make_engine(num_blocks=16, block_size=4, max_num_seqs=1)
    add(core, "running", 8, 50)
    add(core, "waiting", 8, 50)
    core.step()
    assert core.scheduler.kv.num_blocks_in_use > 0
    core.abort("waiting")
    core.abort("running")
    core.abort("running")
    core.abort("never-existed")
    assert not core.has_unfinished
    assert core.scheduler.kv.num_blocks_in_use == 0


def test_stop_token_and_eos_finish_with_stop() -> None:
    runner = FakeRunner()
    prompt = (5, 6, 7)
    expected = expected_output(list(prompt), 5)
    core = EngineCore(
        runner,
        SchedulerConfig(),
        CacheConfig(num_blocks=16),
        max_model_len=1000,
        vocab_size=1000,
        eos_token_ids=frozenset({expected[2]}),
    )
    core.add_request(GenerationInput("eos", prompt, SamplingParams(max_tokens=5)))
    core.add_request(
        GenerationInput(
            "stop",
            prompt,
            SamplingParams(max_tokens=5, ignore_eos=True, stop_token_ids=(expected[3],)),
        )
    )
    core.add_request(GenerationInput("len", prompt, SamplingParams(max_tokens=5, ignore_eos=True)))
    finishes = {}
    while core.has_unfinished:
        for upd in core.step():
            if upd.finish_reason:
                finishes[upd.req_id] = upd.finish_reason
    assert finishes == {
        "eos": FinishReason.STOP,
        "stop": FinishReason.STOP,
        "len": FinishReason.LENGTH,
    }


def test_a_request_past_the_validation_stops_where_the_models_context_ends() -> None:
    """The edge validated it (or it moved here mid-generation): if its max_tokens would
    run past the model's context, it still ends with LENGTH at the last position."""
    core, _ = make_engine(num_blocks=64, max_model_len=40)
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    core.add_request(GenerationInput("long", tuple(range(10, 40)), params), validate=False)
    outputs: list[int] = []
    finish = None
    while core.has_unfinished:
        for upd in core.step():
            outputs += upd.new_token_ids
            finish = upd.finish_reason or finish
    assert finish is FinishReason.LENGTH
    assert len(outputs) == 10  # 30 prompt tokens + 10 = the context's 40


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ((), {}, "prompt"),
        ((1, 2), {"max_tokens": 0}, "max_tokens"),
        ((1, 2), {"temperature": -0.5}, "temperature"),
        ((1, 2), {"top_p": 0.0}, "top_p"),
        ((1, 2), {"top_p": 1.5}, "top_p"),
        ((1, 2), {"top_k": -1}, "top_k"),
        ((1, 5000), {}, "prompt_token_ids"),
        (tuple(range(10, 600)), {"max_tokens": 500}, "context length"),
    ],
)
def test_bad_input_is_refused_before_scheduling(
    prompt: tuple[int, ...], params: dict[str, Any], field: str
) -> None:
    core = EngineCore(
        FakeRunner(),
        SchedulerConfig(),
        CacheConfig(num_blocks=1024),
        max_model_len=1024,
        vocab_size=1000,
    )
    add(core, "good", 4, 3)
    with pytest.raises(ValueError, match=field):
        core.add_request(GenerationInput("bad", prompt, SamplingParams(**params)))
    assert set(core.scheduler.requests) == {"good"}
    assert run_to_completion(core)["good"]
