"""Speculative decoding in the engine core, on the fake runner (milliseconds): outputs are
those of plain decoding, whatever is accepted; stops, lengths, aborts, preemption and
scheduling a step ahead keep working; every block comes back."""

from __future__ import annotations

import pytest

from engine.core.engine_core import EngineCore
from engine.core.request import FinishReason
from engine.sampling_params import SamplingParams
from engine.spec.ngram import NgramIndex
from engine.spec.spec_config import SpeculativeConfig
from engine.spec.speculation import PROPOSAL_TOKEN, accepted_prefix
from engine.wire import GenerationInput
from tests.fakes import (
    FakeRunner,
    RunnerFields,
    add,
    assert_engine_empty,
    make_engine,
    run_to_completion,
)

NGRAM = SpeculativeConfig("ngram", 4, prompt_lookup_min=1, prompt_lookup_max=3)
DRAFT = SpeculativeConfig("draft_model", 4, model="draft")


def cycling_model(last_token: int, position: int) -> int:
    """A model that repeats itself (a cycle of 12 tokens): n-gram proposals hit."""
    return (last_token * 5 + 1) % 12 + 10


def plain_and_speculative(
    spec: SpeculativeConfig,
    runner_kw: RunnerFields,
    requests: list[tuple[str, int, int]],
    *,
    num_blocks: int = 512,
    block_size: int = 16,
    async_scheduling: bool = False,
) -> tuple[dict[str, list[int]], dict[str, list[int]], EngineCore, EngineCore]:
    """Outputs of the same requests without and with speculation."""
    outputs = []
    cores = []
    for config in (None, spec):
        runner = FakeRunner(**runner_kw)
        core, _ = make_engine(
            num_blocks,
            block_size,
            async_scheduling=async_scheduling,
            speculative=config,
            runner=runner,
        )
        for req_id, prompt_len, max_tokens in requests:
            add(core, req_id, prompt_len, max_tokens)
        outputs.append(run_to_completion(core))
        cores.append(core)
    return outputs[0], outputs[1], cores[0], cores[1]


def test_accepted_prefix_keeps_matching_proposals_then_the_samplers_token() -> None:
    assert accepted_prefix((5, 6, 7), (5, 6, 9, 4)) == (5, 6, 9)
    assert accepted_prefix((5, 6, 7), (1, 6, 7, 4)) == (1,)
    assert accepted_prefix((5, 6, 7), (5, 6, 7, 4)) == (5, 6, 7, 4)  # all kept + bonus


def test_ngram_index_proposes_what_followed_the_longest_earliest_match() -> None:
    index = NgramIndex(1, 3)
    tokens = [1, 2, 3, 9, 1, 2, 3, 8, 7, 2, 3]
    # [2, 3] is the longest suffix seen before; its earliest occurrence is at 1.
    assert index.propose(tokens, 3) == (9, 1, 2)
    tokens += [9, 1, 2]  # the index grows with the list
    assert index.propose(tokens, 2) == (3, 8)  # [9, 1, 2] first seen at 3
    assert index.propose([4, 5, 6], 2) == ()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_ngram_output_equals_plain_decoding_with_fewer_steps(async_scheduling: bool) -> None:
    requests = [(f"r{i}", 5 + 3 * i, 40) for i in range(6)]
    plain, spec, _, core = plain_and_speculative(
        NGRAM, {"model": cycling_model}, requests, async_scheduling=async_scheduling
    )
    assert spec == plain
    stats = core.stats()
    assert stats.spec_draft_tokens > 0
    # A repeating model: almost every proposal after the first cycle is accepted.
    assert stats.spec_accepted_tokens > 0.8 * stats.spec_draft_tokens
    assert isinstance(core.runner, FakeRunner)
    assert len(core.runner.batches) < 0.5 * 40
    assert_engine_empty(core)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_draft_proposals_rejected_in_part_still_give_plain_output(async_scheduling: bool) -> None:
    runner_kw: RunnerFields = {"draft_misses": lambda position: position % 3 == 0}
    requests = [(f"r{i}", 3 + 7 * i, 25 + i) for i in range(8)]
    plain, spec, _, core = plain_and_speculative(
        DRAFT, runner_kw, requests, async_scheduling=async_scheduling, block_size=4
    )
    assert spec == plain
    stats = core.stats()
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    assert_engine_empty(core)


def test_stop_token_inside_an_accepted_run_ends_it_there() -> None:
    plain_core, _ = make_engine()
    add(plain_core, "a", 6, 60)
    plain = run_to_completion(plain_core)["a"]
    # Outputs come as 1 (the prompt's step), then runs of 5 (4 accepted + 1): index 8 is
    # inside the second run.
    stop = plain[8]
    first = plain.index(stop)
    assert first == 8
    core, _ = make_engine(speculative=DRAFT)
    prompt = tuple((hash(("a", i)) % 900) + 10 for i in range(6))
    params = SamplingParams(max_tokens=60, ignore_eos=True, stop_token_ids=(stop,))
    core.add_request(GenerationInput("a", prompt, params))
    updates = []
    while core.has_unfinished:
        updates += core.step()
    assert [t for u in updates for t in u.new_token_ids] == plain[: first + 1]
    assert updates[-1].finish_reason is FinishReason.STOP
    assert len(updates[-1].new_token_ids) == 3  # the run's 4th and 5th tokens are dropped
    assert_engine_empty(core)


def test_max_tokens_is_never_passed_and_proposals_stop_short_of_it() -> None:
    core, runner = make_engine(speculative=NGRAM, runner=FakeRunner(model=cycling_model))
    add(core, "a", 4, 23)
    out = run_to_completion(core)
    assert len(out["a"]) == 23
    for batch in runner.batches:
        for seq in batch.seqs:
            # Never a proposal for a token past max_tokens.
            num_outputs_before = seq.start_position + 1 - 4
            assert num_outputs_before + seq.num_draft_tokens <= 23
    assert_engine_empty(core)


def test_disable_by_batch_size_turns_speculation_off_for_large_batches() -> None:
    spec = SpeculativeConfig("ngram", 3, prompt_lookup_min=1, disable_by_batch_size=2)
    core, runner = make_engine(speculative=spec, runner=FakeRunner(model=cycling_model))
    for i, max_tokens in enumerate((10, 12, 40)):
        add(core, f"r{i}", 5, max_tokens)
    run_to_completion(core)
    for batch in runner.batches:
        if batch.num_draft_tokens:
            assert len(batch.seqs) <= 2
    assert core.stats().spec_draft_tokens > 0  # once requests finished, the rest sped up
    assert_engine_empty(core)


def test_rejected_proposals_give_their_blocks_back_at_once() -> None:
    # Blocks of 2 tokens: 4 proposals take up to 3 more blocks than the token needs.
    core, _ = make_engine(
        num_blocks=64,
        block_size=2,
        speculative=DRAFT,
        runner=FakeRunner(draft_misses=lambda position: True),
    )
    add(core, "a", 3, 10)
    while core.has_unfinished:
        core.step()
        req = core.scheduler.requests.get("a")
        if req is not None:
            assert len(core.block_ids("a")) == -(-req.num_tokens // 2)
    assert core.stats().spec_accepted_tokens == 0
    assert_engine_empty(core)


def test_speculation_never_preempts_and_survives_preemption() -> None:
    # 6 blocks of 4 tokens for two requests that each grow to 18 tokens: the cache runs
    # out, so requests are preempted and recomputed; proposals must never cause it.
    requests = [("a", 4, 14), ("b", 5, 13)]
    runner_kw: RunnerFields = {"draft_misses": lambda position: position % 4 == 1}
    plain, spec, plain_core, core = plain_and_speculative(
        DRAFT, runner_kw, requests, num_blocks=6, block_size=4
    )
    assert spec == plain
    assert core.stats().num_preemptions <= plain_core.stats().num_preemptions
    assert_engine_empty(core)


def test_abort_between_verifying_steps_frees_everything() -> None:
    core, _ = make_engine(speculative=DRAFT, runner=FakeRunner(), async_scheduling=True)
    add(core, "a", 5, 50)
    add(core, "b", 5, 50)
    early = [u for _ in range(4) for u in core.step()]
    core.abort("a")
    out = run_to_completion(core)
    assert len(out["b"]) + sum(len(u.new_token_ids) for u in early if u.req_id == "b") == 50
    assert_engine_empty(core)


def test_draft_model_batches_carry_proposal_slots_and_the_missing_draft_context() -> None:
    core, runner = make_engine(speculative=DRAFT, runner=FakeRunner())
    add(core, "a", 7, 12)
    run_to_completion(core)
    verifying = [s for b in runner.batches for s in b.seqs if s.num_draft_tokens]
    assert verifying
    first = verifying[0]
    # The draft model has seen nothing yet: its context is the whole prompt.
    assert len(first.draft_context_ids) == first.start_position == 7
    # Later ones carry only what the draft model has not processed.
    assert all(len(s.draft_context_ids) <= 4 for s in verifying[1:])
    # The scheduler hands proposal slots; the runner's draft model fills them.
    seen = runner.batches  # FakeRunner records the filled batch
    assert all(PROPOSAL_TOKEN not in s.token_ids for b in seen for s in b.seqs)


def test_an_urgent_request_preempts_a_speculating_one_and_both_finish_as_plain() -> None:
    # Room for one request at a time: the urgent one preempts the speculating one, which
    # later recomputes and goes on speculating.
    outputs = []
    for spec in (None, DRAFT):
        core, _ = make_engine(
            speculative=spec,
            runner=FakeRunner(draft_misses=lambda position: position % 5 == 0),
            policy="priority",
            max_num_seqs=1,
        )
        add(core, "slow", 6, 30, priority=5)
        early = [u for _ in range(3) for u in core.step()]
        add(core, "urgent", 4, 10, priority=0)
        out = run_to_completion(core)
        out["slow"] = [t for u in early for t in u.new_token_ids] + out["slow"]
        outputs.append(out)
        assert core.stats().num_preemptions == 1
        assert_engine_empty(core)
    assert outputs[0] == outputs[1]
