"""Cache-aware routing.

Prefill workers (`choose_by_work`): the one that would finish the prompt soonest,
counted in tokens: the uncached prompt tokens already queued there (times
`queue_weight`) plus this prompt's tokens its cache lacks (cached tokens are free), plus
`prefill_request_tokens` per prompt in flight there and a small cache-balance term.
Queued work, not a hit score with a load cut-off: a worker holding the prompt's prefix
wins until its queue costs more than the prefix saves, so a system prompt every session
shares spreads over the pool instead of pinning it to one worker.

Decode and colocated workers (`choose_worker`), which hold running requests rather
than a queue of prompts:

Score of a live candidate = cached prompt tokens - load_penalty_tokens x requests in
flight on it - cache_balance_tokens x (blocks its cache holds / blocks the fullest
live cache holds). A candidate whose load exceeds the bound (more than
max(min_load x overload_ratio, min_load + overload_slack), min_load taken over live
workers) is left out for this request only: a hot worker that holds a popular
prefix loses that prefix's traffic to the others until it cools down, while every
other request is still routed by its cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from router.routing.kv_index import PrefixIndex

RoutingPolicy = Literal["least-loaded", "prefix-aware"]
ROUTING_POLICIES: tuple[RoutingPolicy, ...] = ("least-loaded", "prefix-aware")


@dataclass(frozen=True)
class WorkerLoadView:
    """What the router knows about one worker when it routes."""

    index: int
    alive: bool
    num_assigned: int  # requests in flight on the worker, from every router process
    num_blocks_free: int = 0


class LoadView(Protocol):
    """What routing reads of a worker (WorkerLoadView fits)."""

    @property
    def index(self) -> int: ...
    @property
    def alive(self) -> bool: ...
    @property
    def num_assigned(self) -> int: ...
    @property
    def num_blocks_free(self) -> int: ...


@dataclass(frozen=True)
class RoutingConfig:
    """How the router trades cache hits against load."""

    policy: RoutingPolicy = "prefix-aware"
    # Cached prompt tokens that one request in flight on a worker is worth giving up.
    load_penalty_tokens: float = 128.0
    # Cached prompt tokens given up to avoid the worker whose cache holds the most
    # (scaled by its share of the fullest cache): without it a prefix every prompt
    # shares pins new sessions to one worker, whose cache then thrashes while the
    # others stay empty. Less than one block's worth (16 tokens by default), so it only
    # decides between workers that hold the same number of the prompt's blocks: a worker
    # with one more matching block always wins on the cache.
    cache_balance_tokens: float = 8.0
    # Prefill workers: what a token already queued there costs against a token the
    # prompt's cache lacks. Below 1 because a cache hit also serves the session's later
    # turns, which the queue does not see: in simulated multi-turn sessions the hit rate
    # came closer to an oracle's at 0.5 than at 1.
    queue_weight: float = 0.5
    # Prefill workers: the fixed cost of one more prompt in flight there, in tokens.
    # Small: a worker runs the prompts queued there together, in shared steps, and their
    # tokens are counted already (`queue_weight`); a decode worker's `load_penalty_tokens`
    # here sent a session's turn away from its history whenever two short prompts were
    # queued there, to finish later where it went.
    prefill_request_tokens: float = 16.0
    # Load bound: a worker above max(min_load * ratio, min_load + slack) is skipped.
    overload_ratio: float = 1.5
    overload_slack: int = 4

    def __post_init__(self) -> None:
        if self.policy not in ROUTING_POLICIES:
            raise ValueError(
                f"routing policy must be one of {', '.join(ROUTING_POLICIES)}, got {self.policy!r}"
            )
        if self.load_penalty_tokens < 0:
            raise ValueError(f"load_penalty_tokens must be >= 0, got {self.load_penalty_tokens}")
        if self.cache_balance_tokens < 0:
            raise ValueError(f"cache_balance_tokens must be >= 0, got {self.cache_balance_tokens}")
        if self.overload_ratio < 1.0:
            raise ValueError(f"overload_ratio must be >= 1.0, got {self.overload_ratio}")
        if self.prefill_request_tokens < 0:
            raise ValueError(
                f"prefill_request_tokens must be >= 0, got {self.prefill_request_tokens}"
            )
        if self.queue_weight < 0:
            raise ValueError(f"queue_weight must be >= 0, got {self.queue_weight}")
        if self.overload_slack < 0:
            raise ValueError(f"overload_slack must be >= 0, got {self.overload_slack}")

    def load_bound(self, min_load: int) -> float:
        """Most requests in flight a worker may have and still be chosen for its cache."""
        return max(min_load * self.overload_ratio, min_load + self.overload_slack)


@dataclass(frozen=True)
class RouteChoice:
    """The chosen worker and the prompt tokens its cache is expected to serve."""

    index: int
    num_cached_tokens: int


def load_order(w: LoadView) -> tuple[int, int, int]:
    """Least loaded first: fewest in flight, most free blocks, lowest index."""
    return (w.num_assigned, -w.num_blocks_free, w.index)


def choose_by_work(
    workers: Sequence[LoadView],
    queued_tokens: Sequence[int],
    index: PrefixIndex,
    block_hashes: Sequence[int],
    num_prompt_tokens: int,
    config: RoutingConfig,
) -> RouteChoice | None:
    """The live worker with the least estimated prefill work for this prompt, in tokens:
    `queued_tokens[i]` is what the router already sent to `workers[i]`."""
    live = [(w, q) for w, q in zip(workers, queued_tokens, strict=True) if w.alive]
    if not live:
        return None
    if config.policy == "least-loaded":
        best = min((w for w, _ in live), key=load_order)
        return RouteChoice(best.index, index.num_cached_tokens(best.index, block_hashes))
    most_cached = max(index.num_blocks(w.index) for w, _ in live) or 1
    best_key: tuple[float, int, int, int, int, int] | None = None
    choice: RouteChoice | None = None
    for w, queued in live:
        cached = index.num_cached_tokens(w.index, block_hashes)
        work = (
            config.queue_weight * queued
            + num_prompt_tokens
            - cached
            + config.prefill_request_tokens * w.num_assigned
            + config.cache_balance_tokens * index.num_blocks(w.index) / most_cached
        )
        key = (work, w.num_assigned, index.num_blocks(w.index), *load_order(w))
        if best_key is None or key < best_key:
            best_key, choice = key, RouteChoice(w.index, cached)
    return choice


def choose_worker(
    workers: Sequence[LoadView],
    index: PrefixIndex,
    block_hashes: Sequence[int],
    config: RoutingConfig,
) -> RouteChoice | None:
    """The live worker to run a prompt with these block hashes; None if none is alive.

    `block_hashes` comes from index.hash_prompt(prompt_token_ids). Under
    least-loaded the cache is ignored for the choice but still reported.
    """
    live = [w for w in workers if w.alive]
    if not live:
        return None
    if config.policy == "least-loaded":
        best = min(live, key=load_order)
        return RouteChoice(best.index, index.num_cached_tokens(best.index, block_hashes))
    bound = config.load_bound(min(w.num_assigned for w in live))
    most_cached = max(index.num_blocks(w.index) for w in live) or 1
    best_key: tuple[float, int, int, int, int, int] | None = None
    choice: RouteChoice | None = None
    for w in live:
        if w.num_assigned > bound:
            continue  # the least-loaded worker is never above the bound
        cached = index.num_cached_tokens(w.index, block_hashes)
        score = (
            cached
            - config.load_penalty_tokens * w.num_assigned
            - config.cache_balance_tokens * index.num_blocks(w.index) / most_cached
        )
        # Ties: fewer in flight, then the emptier cache, then the usual load order.
        key = (-score, w.num_assigned, index.num_blocks(w.index), *load_order(w))
        if best_key is None or key < best_key:
            best_key, choice = key, RouteChoice(w.index, cached)
    return choice
