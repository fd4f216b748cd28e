"""KV events: the engine reports the chain hashes its prefix cache stores and evicts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine.core.block_pool import prefix_block_hashes
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.kv_events import KVEventBuffer
from engine.sampling_params import SamplingParams
from engine.wire import GenerationInput, KVEvents


def run_prompt(kv: KVCacheManager, req_id: str, tokens: list[int]) -> int:
    """Prefill one prompt as the scheduler would, then free it; returns the hit tokens."""
    prefix = kv.find_cached_prefix(tokens)
    hit = len(prefix) * kv.block_size
    assert kv.allocate_slots(req_id, hit, len(tokens) - hit, prefix) is not None
    kv.cache_full_blocks(req_id, tokens, len(tokens))
    kv.free(req_id)
    return hit


def test_first_drain_is_a_snapshot_then_deltas() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    assert kv.take_kv_events() == KVEvents(full=True)
    prompt = list(range(100, 113))  # 3 full blocks + 1 token
    run_prompt(kv, "a", prompt)
    events = kv.take_kv_events()
    assert not events.full
    assert set(events.stored) == set(prefix_block_hashes(prompt, 4))
    assert events.removed == ()
    assert kv.take_kv_events().is_empty


def test_router_hashes_match_what_the_engine_hits() -> None:
    kv = KVCacheManager(num_blocks=32, block_size=4)
    kv.take_kv_events()
    history = list(range(1, 22))
    run_prompt(kv, "t1", history)
    cached = set(kv.take_kv_events().stored)
    turn2 = history + [7, 7, 7, 7, 7]
    predicted = prefix_block_hashes(turn2, 4)
    num_predicted = 0
    for h in predicted:
        if h not in cached:
            break
        num_predicted += 1
    assert run_prompt(kv, "t2", turn2) == num_predicted * 4 == 20


def test_eviction_is_reported_as_removed() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    kv.take_kv_events()
    first = list(range(1, 14))  # 3 cached blocks, 4 used while running
    run_prompt(kv, "a", first)
    stored_first = set(kv.take_kv_events().stored)
    assert len(stored_first) == 3
    second = list(range(500, 513))  # needs all 4 blocks: evicts every cached one
    run_prompt(kv, "b", second)
    events = kv.take_kv_events()
    assert set(events.removed) == stored_first
    assert len(events.stored) == 3 and not set(events.stored) & stored_first


def test_stored_then_evicted_in_one_batch_nets_out() -> None:
    buf = KVEventBuffer(max_pending=8)
    buf.take([])
    buf.stored(1)
    buf.removed(1)
    buf.stored(2)
    buf.removed(3)
    buf.stored(3)
    events = buf.take([])
    assert set(events.stored) == {2, 3} and events.removed == (1,)


def test_overflow_turns_the_next_batch_into_a_snapshot() -> None:
    buf = KVEventBuffer(max_pending=2)
    buf.take([])
    for h in range(5):
        buf.stored(h)
    events = buf.take([3, 4])
    assert events.full and events.stored == (3, 4)
    assert buf.take([3, 4]).is_empty


def test_hashes_agree_across_processes() -> None:
    # The router and the engines are separate processes: the hash must not depend on
    # per-process state such as the address of None or string hash randomisation.
    code = "from engine.core.block_pool import prefix_block_hashes as p; print(p(range(40), 8))"
    outs = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout.strip()
        for _ in range(2)
    }
    assert outs == {str(prefix_block_hashes(list(range(40)), 8))}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_decoding_reports_each_block_at_the_step_that_fills_it(async_scheduling: bool) -> None:
    """A block of output tokens joins the prefix cache (and the router's index) at the
    step whose results complete it, not later: a follow-up turn can hit it at once."""
    from tests.fakes import make_engine

    core, _ = make_engine(num_blocks=64, block_size=4, async_scheduling=async_scheduling)
    core.take_kv_events()
    prompt = tuple(range(10, 16))  # one full block + 2 tokens
    core.add_request(GenerationInput("r", prompt, SamplingParams(max_tokens=13, ignore_eos=True)))
    stored: set[int] = set()
    steps = 0
    while core.has_unfinished:
        core.step()
        steps += 1
        stored |= set(core.take_kv_events().stored)
        req = core.scheduler.requests.get("r")
        if req is None:
            break
        # Every full block of the computed tokens (one token more: the lookup's own rule
        # leaves the last token out).
        computed = [*req.all_token_ids[: req.num_computed_tokens], 0]
        assert stored == set(prefix_block_hashes(computed, 4)), f"after step {steps}"
    # 6 + 13 tokens, the last never computed: 4 full blocks in the cache.
    assert len(stored) == 4
