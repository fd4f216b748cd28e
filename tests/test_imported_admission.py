"""Decode pool: requests whose KV arrived by hand-off obey max_num_seqs and the policy.

They wait for a slot holding their imported blocks, go ahead of prompts of the same
priority, preempt a less urgent request under the priority policy, and never leak.
"""

from __future__ import annotations

import pytest

from engine.core.engine_core import EngineCore
from engine.core.request import RequestStatus
from engine.sampling_params import SamplingParams
from engine.wire import GenerationInput
from tests.fakes import (
    add,
    assert_engine_empty,
    expected_output,
    make_engine,
    next_token,
    run_to_completion,
)


def import_request(
    core: EngineCore, req_id: str, prompt_len: int, max_tokens: int, priority: int = 0
) -> list[int]:
    """Reserve blocks, then admit the request as a decode worker does after the KV arrived.
    Returns every token the request should produce (the first came with the hand-off)."""
    prompt = [(hash((req_id, i)) % 900) + 10 for i in range(prompt_len)]
    assert core.reserve(req_id, prompt_len) is not None
    first = next_token(prompt[-1], prompt_len)  # what the prefill engine sampled
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    core.admit_imported(GenerationInput(req_id, tuple(prompt), sampling, priority), first)
    return [first, *expected_output([*prompt, first], max_tokens - 1)]


def scheduled(core: EngineCore) -> set[str]:
    return {s.req_id for s in core.scheduler.schedule().seqs}


def waiting_ids(core: EngineCore) -> list[str]:
    return [r.req_id for r in core.scheduler.waiting]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_imported_requests_wait_for_a_slot_under_max_num_seqs(async_scheduling: bool) -> None:
    core, _ = make_engine(max_num_seqs=2, block_size=4, async_scheduling=async_scheduling)
    expected = {r: import_request(core, r, 8, n) for r, n in (("a", 3), ("b", 10), ("c", 5))}
    outputs = {r: tokens[:1] for r, tokens in expected.items()}
    first_step = True
    while core.has_unfinished:
        for upd in core.step():
            outputs[upd.req_id].extend(upd.new_token_ids)
        assert core.scheduler.num_running <= 2
        if first_step:
            assert {r.req_id for r in core.scheduler.running} == {"a", "b"}
            assert waiting_ids(core) == ["c"] and core.scheduler.kv.holds("c")  # KV waits too
            first_step = False
    assert outputs == expected  # the imported KV was used, not recomputed differently
    assert_engine_empty(core)


def test_imported_requests_go_ahead_of_waiting_prompts() -> None:
    core, runner = make_engine(max_num_seqs=1, block_size=4)
    add(core, "running", 8, 2)
    core.step()
    add(core, "prompt", 8, 2)  # arrived first, but has no KV yet
    import_request(core, "imported", 8, 2)
    assert waiting_ids(core) == ["imported", "prompt"]
    run_to_completion(core)
    started = [s.req_id for b in runner.batches for s in b.seqs if s.req_id != "running"]
    assert list(dict.fromkeys(started)) == ["imported", "prompt"]
    assert_engine_empty(core)


def test_an_urgent_import_preempts_and_an_equal_one_waits() -> None:
    core, _ = make_engine(max_num_seqs=2, block_size=4, policy="priority")
    add(core, "bulk0", 8, 30, priority=5)
    add(core, "bulk1", 8, 30, priority=5)
    core.step()
    import_request(core, "same", 8, 4, priority=5)
    assert scheduled(core) == {"bulk0", "bulk1"}  # equal priority never preempts
    expected = import_request(core, "urgent", 8, 4, priority=0)
    assert "urgent" in scheduled(core)
    assert core.scheduler.num_running == 2
    assert waiting_ids(core) == ["same", "bulk1"]  # the latest of the least urgent
    assert core.scheduler.requests["bulk1"].status is RequestStatus.PREEMPTED
    outputs = run_to_completion(core)
    assert [expected[0], *outputs["urgent"]] == expected
    assert_engine_empty(core)


def test_aborting_a_waiting_import_frees_its_blocks() -> None:
    core, _ = make_engine(max_num_seqs=1, block_size=4)
    add(core, "running", 8, 50)
    core.step()
    import_request(core, "imported", 8, 5)
    core.step()
    assert waiting_ids(core) == ["imported"]
    in_use = len(core.scheduler.kv.block_ids("running"))
    assert core.scheduler.kv.num_blocks_in_use == in_use + 2  # 8 imported tokens
    core.abort("imported")
    core.abort("imported")
    assert core.scheduler.kv.num_blocks_in_use == in_use
    assert not core.scheduler.kv.holds("imported")
    core.abort("running")
    assert_engine_empty(core)


def test_waiting_imports_that_hold_every_block_do_not_deadlock() -> None:
    # Two imports fill the cache and each needs one more block; nothing runs to free one.
    core, _ = make_engine(num_blocks=4, block_size=4)
    expected = {r: import_request(core, r, 8, 3) for r in ("a", "b")}
    assert core.scheduler.kv.num_free_blocks == 0
    outputs = run_to_completion(core)
    assert {r: [expected[r][0], *outputs[r]] for r in outputs} == expected
    assert_engine_empty(core)
