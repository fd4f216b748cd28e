"""Property tests: random add / abort / step sequences keep the block pool and scheduler sound."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.config import CacheConfig, SchedulerConfig
from engine.core.engine_core import EngineCore
from engine.core.request import PLACEHOLDER_TOKEN, FinishReason
from engine.sampling_params import SamplingParams
from engine.wire import GenerationInput
from tests.fakes import FakeRunner, assert_engine_empty, expected_output

ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"),
            st.integers(1, 40),  # prompt length
            st.integers(1, 12),  # max tokens
            st.integers(0, 2),  # priority
            st.integers(0, 3),  # which shared prefix (0 = none)
        ),
        st.tuples(st.just("abort"), st.integers(0, 50)),
        st.tuples(st.just("step"), st.integers(1, 4)),
    ),
    max_size=60,
)

configs = st.builds(
    SchedulerConfig,
    max_num_seqs=st.integers(1, 6),
    max_num_batched_tokens=st.integers(8, 64),
    long_prefill_token_threshold=st.sampled_from([0, 5, 16]),
    enable_prefix_caching=st.booleans(),
    policy=st.sampled_from(["fcfs", "priority"]),
    prioritize_prefill=st.booleans(),
)


def check_invariants(core: EngineCore, batch_tokens: int, batch_ids: set[str]) -> None:
    kv = core.scheduler.kv
    pool = kv.pool
    owners = Counter(b for req_id in list(kv._tables) for b in kv.block_ids(req_id))
    for block in pool.blocks:
        # Shared prefix blocks appear in several tables; each table holds one reference.
        assert block.ref_cnt == owners.get(block.block_id, 0), block
        assert (block.ref_cnt == 0) == (block.block_id in pool._free)
    for req_id in kv._tables:
        assert len(set(kv.block_ids(req_id))) == len(kv.block_ids(req_id)), "block twice in a table"
    assert pool.num_free_blocks + sum(1 for b in pool.blocks if b.ref_cnt) == pool.num_blocks
    cfg = core.scheduler.config
    assert batch_tokens <= cfg.step_tokens
    assert len(core.scheduler.running) <= cfg.max_num_seqs
    if batch_tokens < cfg.step_tokens:
        # Budget left over: no running request was starved this step, except one whose
        # token still being sampled ends it (scheduling one step ahead skips those).
        ending = {
            r.req_id
            for r in core.scheduler.running
            if r.output_token_ids
            and r.output_token_ids[-1] == PLACEHOLDER_TOKEN
            and r.length_stop(r.num_output_tokens)
        }
        assert {r.req_id for r in core.scheduler.running} - ending <= batch_ids


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "one-step-ahead"])
@settings(max_examples=120, deadline=None)
@given(config=configs, num_blocks=st.integers(12, 40), script=ops)
def test_random_workloads_keep_blocks_consistent(
    async_scheduling: bool, config: SchedulerConfig, num_blocks: int, script: list[tuple]
) -> None:
    runner = FakeRunner()
    core = EngineCore(
        runner,
        config,
        CacheConfig(num_blocks=num_blocks, block_size=4),
        max_model_len=4 * num_blocks,
        vocab_size=1000,
        async_scheduling=async_scheduling,
    )
    prompts: dict[str, list[int]] = {}
    outputs: dict[str, list[int]] = {}
    finished: dict[str, FinishReason] = {}
    next_id = 0

    def step() -> None:
        before = len(runner.batches)
        for upd in core.step():
            assert upd.req_id not in finished, "an update after the terminal one (or an abort)"
            outputs.setdefault(upd.req_id, []).extend(upd.new_token_ids)
            if upd.finish_reason:
                assert upd.req_id not in finished, "two terminal updates"
                finished[upd.req_id] = upd.finish_reason
        if len(runner.batches) > before:
            batch = runner.batches[-1]
            check_invariants(core, batch.num_tokens, {s.req_id for s in batch.seqs})

    for op in script:
        if op[0] == "add":
            _, plen, max_tokens, priority, prefix = op
            prompt = [100 + prefix] * (8 if prefix else 0) + [
                (next_id * 13 + i) % 900 + 5 for i in range(plen)
            ]
            if len(prompt) + max_tokens > 4 * num_blocks:
                continue
            req_id = f"r{next_id}"
            next_id += 1
            prompts[req_id] = prompt
            sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            core.add_request(GenerationInput(req_id, tuple(prompt), sp, priority=priority))
        elif op[0] == "abort":
            if next_id:
                req_id = f"r{op[1] % next_id}"
                if req_id in core.scheduler.requests:
                    finished.setdefault(req_id, FinishReason.ABORT)
                core.abort(req_id)
        else:
            for _ in range(op[1]):
                step()
    for _ in range(2000):
        if not core.has_unfinished:
            break
        step()
    assert not core.has_unfinished, "a request never finished (starved)"
    assert_engine_empty(core)
    assert set(finished) == set(prompts)
    for req_id, reason in finished.items():
        if reason is FinishReason.LENGTH:
            # Preemption and recompute never change what a request generates.
            want = expected_output(prompts[req_id], len(outputs[req_id]))
            assert outputs[req_id] == want
