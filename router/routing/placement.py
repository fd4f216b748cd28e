"""Which workers a prompt goes to, and where it runs: the serving core's routing, over
the live pools' load accounts and the prefix indexes (no calls to any worker)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from engine.wire import PoolName
from router.routing.cache_aware import RoutingConfig, choose_by_work, choose_worker
from router.routing.kv_index import PrefixIndex
from router.routing.prefill_policy import PathDecision, PathInputs, PrefillPolicyConfig, decide
from router.serving.workers import WorkerRef

Route = Callable[[Sequence[WorkerRef]], WorkerRef]


def route_by_cache(index: PrefixIndex, hashes: list[int], config: RoutingConfig) -> Route:
    """Decode and colocated workers: cache overlap against requests in flight."""

    def pick(live: Sequence[WorkerRef]) -> WorkerRef:
        by_index = {w.index: w for w in live}
        choice = choose_worker([w.view() for w in live], index, hashes, config)
        assert choice is not None  # live is not empty
        return by_index[choice.index]

    return pick


def route_by_work(
    index: PrefixIndex, hashes: list[int], num_prompt: int, config: RoutingConfig
) -> Route:
    """Prefill workers: least estimated work, queued plus uncached tokens."""

    def pick(live: Sequence[WorkerRef]) -> WorkerRef:
        by_index = {w.index: w for w in live}
        queued = [w.load.service_queued_tokens for w in live]
        choice = choose_by_work([w.view() for w in live], queued, index, hashes, num_prompt, config)
        assert choice is not None
        return by_index[choice.index]

    return pick


def place_prompt(
    *,
    num_prompt: int,
    max_tokens: int,
    hashes: list[int],
    decode_ref: WorkerRef,
    prefill_candidates: Sequence[WorkerRef],
    indexes: dict[PoolName, PrefixIndex],
    routing: RoutingConfig,
    policy: PrefillPolicyConfig,
    block_size: int,
) -> tuple[PathDecision, WorkerRef | None, int]:
    """Where the prompt runs: (decision, the prefill worker if remote, the prompt's
    uncached tokens there)."""
    prefill_ref = None
    if prefill_candidates:
        prefill_ref = route_by_work(indexes[PoolName.PREFILL], hashes, num_prompt, routing)(
            prefill_candidates
        )
    cached_prefill = (
        indexes[PoolName.PREFILL].num_cached_tokens(prefill_ref.index, hashes) if prefill_ref else 0
    )
    stats = decode_ref.load.stats
    inputs = PathInputs(
        has_prefill=prefill_ref is not None,
        num_uncached_decode=num_prompt
        - indexes[PoolName.DECODE].num_cached_tokens(decode_ref.index, hashes),
        num_uncached_prefill=num_prompt - cached_prefill,
        prefill_queued_tokens=prefill_ref.load.service_queued_tokens if prefill_ref else 0,
        prefill_tokens_per_s=prefill_ref.load.prefill_rate.tokens_per_s.value
        if prefill_ref
        else None,
        handoff_s=decode_ref.load.handoff_s.value or 0.0,
        decode_running=stats.num_running if stats is not None else 0,
        decode_step_s=decode_ref.load.decode_step_s(time.monotonic()),
        decode_queued_tokens=decode_ref.load.service_queued_tokens,
        decode_free_blocks=stats.num_blocks_free if stats is not None else None,
        decode_local_s_per_token=decode_ref.load.local_prefill_s_per_token.value,
        num_prompt_blocks=-(-num_prompt // block_size),
        num_output_tokens=max_tokens,
    )
    decision = decide(inputs, policy)
    if decision.path == "local":
        return decision, None, 0
    return decision, prefill_ref, num_prompt - cached_prefill
