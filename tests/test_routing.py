"""Prefix-aware routing over fake workers: the index follows events, dead workers are
never chosen, and the load bound sends a hot worker's traffic elsewhere."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from engine.core.kv_cache_manager import KVCacheManager
from engine.wire import KVEvents
from router.routing.cache_aware import RouteChoice, RoutingConfig, choose_by_work, choose_worker
from router.routing.kv_index import PrefixIndex

BLOCK = 4
# Cache balancing off, where a test is about overlap and load alone.
PLAIN = RoutingConfig(cache_balance_tokens=0)


@dataclass(frozen=True)
class FakeWorker:
    index: int
    alive: bool = True
    num_assigned: int = 0
    num_blocks_free: int = 100


def prompt(system: int, n: int) -> list[int]:
    """`n` tokens that start with a system prompt shared by every prompt of that `system`."""
    return [1000 * system + i for i in range(n)]


def index_with(holdings: dict[int, list[int]]) -> PrefixIndex:
    """An index where worker w holds the full blocks of holdings[w] (its cached prompt)."""
    idx = PrefixIndex(BLOCK)
    for w, tokens in holdings.items():
        idx.apply(w, KVEvents(stored=tuple(idx.hash_prompt(tokens)), full=True))
    return idx


def test_prompt_goes_to_the_worker_holding_its_prefix() -> None:
    idx = index_with({0: prompt(1, 41), 1: prompt(2, 41)})
    workers = [FakeWorker(0), FakeWorker(1)]
    hashes = idx.hash_prompt(prompt(2, 60))
    assert choose_worker(workers, idx, hashes, RoutingConfig()) == RouteChoice(1, 40)
    # Least-loaded ignores the cache for the choice (ties go to the lower index).
    least = choose_worker(workers, idx, hashes, RoutingConfig(policy="least-loaded"))
    assert least == RouteChoice(0, 0)


def test_eviction_events_remove_entries() -> None:
    idx = index_with({0: prompt(1, 41), 1: prompt(1, 21)})
    hashes = idx.hash_prompt(prompt(1, 60))
    workers = [FakeWorker(1), FakeWorker(0)]
    assert choose_worker(workers, idx, hashes, PLAIN) == RouteChoice(0, 40)
    # Worker 0 evicts its third block: the chain breaks there, so only 8 tokens remain.
    idx.apply(0, KVEvents(removed=(hashes[2],)))
    assert idx.num_cached_tokens(0, hashes) == 8
    assert choose_worker(workers, idx, hashes, PLAIN) == RouteChoice(1, 20)


def test_index_follows_a_real_engine_cache() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=BLOCK)
    idx = PrefixIndex(BLOCK)
    for req_id, tokens in (("a", prompt(1, 21)), ("b", prompt(2, 21))):
        prefix = kv.find_cached_prefix(tokens)
        hit = len(prefix) * BLOCK
        assert kv.allocate_slots(req_id, hit, len(tokens) - hit, prefix) is not None
        kv.cache_full_blocks(req_id, tokens, len(tokens))
        kv.free(req_id)
        idx.apply(7, kv.take_kv_events())
    # "b" needed all 6 blocks, so every block of "a" was evicted and reported.
    assert idx.num_cached_tokens(7, idx.hash_prompt(prompt(1, 30))) == 0
    assert idx.num_cached_tokens(7, idx.hash_prompt(prompt(2, 30))) == 20
    assert idx.num_blocks(7) == 5


def test_a_dead_worker_is_never_chosen() -> None:
    idx = index_with({0: prompt(1, 80)})
    hashes = idx.hash_prompt(prompt(1, 80))
    workers = [FakeWorker(0, alive=False), FakeWorker(1, num_assigned=50)]
    assert choose_worker(workers, idx, hashes, RoutingConfig()) == RouteChoice(1, 0)
    assert choose_worker([FakeWorker(0, alive=False)], idx, hashes, RoutingConfig()) is None


def test_a_removed_worker_drops_out_of_the_index_at_once() -> None:
    idx = index_with({0: prompt(1, 41), 1: prompt(1, 41)})
    idx.remove_worker(0)
    idx.remove_worker(0)
    assert idx.workers == frozenset({1})
    assert idx.num_cached_tokens(0, idx.hash_prompt(prompt(1, 41))) == 0


def test_a_full_batch_replaces_what_a_restarted_worker_held() -> None:
    idx = index_with({0: prompt(1, 41)})
    idx.apply(0, KVEvents(full=True))
    assert idx.num_blocks(0) == 0


def test_load_penalty_trades_hits_for_load() -> None:
    idx = index_with({0: prompt(1, 41)})
    hashes = idx.hash_prompt(prompt(1, 41))  # 40 cached tokens on worker 0
    workers = [FakeWorker(0, num_assigned=2), FakeWorker(1, num_assigned=1)]
    cheap = RoutingConfig(load_penalty_tokens=10, cache_balance_tokens=0)  # 40 - 20 beats 0 - 10
    assert choose_worker(workers, idx, hashes, cheap) == RouteChoice(0, 40)
    dear = RoutingConfig(load_penalty_tokens=50, cache_balance_tokens=0)  # 40 - 100 loses to 0 - 50
    assert choose_worker(workers, idx, hashes, dear) == RouteChoice(1, 0)


def test_load_bound_moves_only_the_hot_workers_prefix() -> None:
    idx = index_with({0: prompt(1, 401), 1: prompt(2, 401)})
    config = RoutingConfig(load_penalty_tokens=1, overload_ratio=1.5, overload_slack=4)
    hot = [FakeWorker(0, num_assigned=10), FakeWorker(1, num_assigned=2), FakeWorker(2)]
    # Worker 0 holds 400 cached tokens but 10 > max(0 * 1.5, 0 + 4): over the bound.
    assert choose_worker(hot, idx, idx.hash_prompt(prompt(1, 500)), config) == RouteChoice(2, 0)
    # Worker 1 is under the bound, so its own prefix still goes to it.
    assert choose_worker(hot, idx, idx.hash_prompt(prompt(2, 500)), config) == RouteChoice(1, 400)
    # Just at the bound counts as not overloaded.
    at_bound = [FakeWorker(0, num_assigned=4), FakeWorker(2)]
    choice = choose_worker(at_bound, idx, idx.hash_prompt(prompt(1, 500)), config)
    assert choice is not None and choice.index == 0


def test_a_shared_prefix_does_not_pin_new_sessions_to_one_full_cache() -> None:
    # Worker 0 holds the shared system prompt (8 tokens) and 100 blocks of histories;
    # worker 1 holds only the system prompt. A new session goes to worker 1 ...
    idx = index_with({0: prompt(1, 9), 1: prompt(1, 9)})
    idx.apply(0, KVEvents(stored=tuple(range(100))))
    workers = [FakeWorker(0), FakeWorker(1)]
    new_session = idx.hash_prompt(prompt(1, 30))
    assert choose_worker(workers, idx, new_session, RoutingConfig()) == RouteChoice(1, 8)
    # ... while a long cached history still outweighs the fuller cache.
    idx.apply(0, KVEvents(stored=tuple(idx.hash_prompt(prompt(1, 400)))))
    history = idx.hash_prompt(prompt(1, 420))
    assert choose_worker(workers, idx, history, RoutingConfig()) == RouteChoice(0, 396)


def test_config_rejects_unknown_policy() -> None:
    with pytest.raises(ValueError, match="least-loaded, prefix-aware"):
        RoutingConfig(policy="random")  # type: ignore[arg-type]


def test_prefill_work_counts_cached_tokens_as_free_and_queued_ones_against() -> None:
    config = RoutingConfig(cache_balance_tokens=0, load_penalty_tokens=0, queue_weight=1.0)
    idx = index_with({0: prompt(1, 40)})  # worker 0 holds the prefix's first 36 tokens
    p = prompt(1, 64)
    workers = [FakeWorker(0), FakeWorker(1)]
    hashes = idx.hash_prompt(p)
    # Idle: worker 0 has 28 tokens to compute, worker 1 all 64.
    choice = choose_by_work(workers, [0, 0], idx, hashes, len(p), config)
    assert choice == RouteChoice(0, 36)
    # 50 tokens already queued on worker 0: 78 there against 64 on the empty worker 1.
    assert choose_by_work(workers, [50, 0], idx, hashes, len(p), config) == RouteChoice(1, 0)
    # A queued token costs half an uncached one by default: worker 0 keeps the session.
    default = RoutingConfig(cache_balance_tokens=0, load_penalty_tokens=0)
    kept = choose_by_work(workers, [50, 0], idx, hashes, len(p), default)
    assert kept is not None and kept.index == 0
    # Dead workers are never chosen, and none alive means no choice.
    dead0 = [FakeWorker(0, alive=False), FakeWorker(1)]
    live = choose_by_work(dead0, [0, 0], idx, hashes, len(p), config)
    assert live is not None and live.index == 1
    assert choose_by_work([FakeWorker(0, alive=False)], [0], idx, hashes, 8, config) is None


def test_a_turn_stays_with_its_history_behind_two_short_queued_prompts() -> None:
    """Sessions in step: worker 0 holds this session's 96-token history and is already
    running two other sessions' turns (69 uncached tokens each); worker 1 runs one. Two
    more prompts together cost worker 0 far less than this whole prompt costs worker 1,
    so the turn stays (a decode worker's per-request weight sent it away)."""
    idx = index_with({0: prompt(1, 100), 1: prompt(2, 100)})
    p = prompt(1, 165)
    hashes = idx.hash_prompt(p)
    workers = [FakeWorker(0, num_assigned=2), FakeWorker(1, num_assigned=1)]
    choice = choose_by_work(workers, [138, 69], idx, hashes, len(p), RoutingConfig())
    assert choice == RouteChoice(0, 96)
    heavy = RoutingConfig(prefill_request_tokens=128)
    moved = choose_by_work(workers, [138, 69], idx, hashes, len(p), heavy)
    assert moved is not None and moved.index == 1
