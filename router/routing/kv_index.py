"""The router's view of every worker's prefix cache, fed by the engines' KV events.

Per worker, the set of full-block chain hashes it holds. Chain hashes commit to
every block before them, so a prompt's cached prefix on a worker is the leading
run of its block hashes found in that worker's set. The view lags the engine by
one event batch; that is a routing hint, never a correctness matter (the engine
confirms each hit by comparing tokens).
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.core.block_pool import prefix_block_hashes
from engine.wire import KVEvents


class PrefixIndex:
    """Which chain hashes each live worker's prefix cache holds."""

    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self._hashes: dict[int, set[int]] = {}

    def hash_prompt(self, token_ids: Sequence[int]) -> list[int]:
        """Chain hashes of the prompt's full blocks, exactly as the engine computes them."""
        return prefix_block_hashes(token_ids, self.block_size)

    def apply(self, worker: int, events: KVEvents) -> None:
        """Fold one event batch from a worker in (a full batch replaces what was known)."""
        if events.full:
            self._hashes[worker] = set(events.stored)
            return
        held = self._hashes.setdefault(worker, set())
        held.difference_update(events.removed)
        held.update(events.stored)

    def remove_worker(self, worker: int) -> None:
        """Forget a dead or drained worker at once; idempotent."""
        self._hashes.pop(worker, None)

    @property
    def workers(self) -> frozenset[int]:
        return frozenset(self._hashes)

    def num_blocks(self, worker: int) -> int:
        """Hashes known for the worker (0 if unknown)."""
        return len(self._hashes.get(worker, ()))

    def num_cached_tokens(self, worker: int, block_hashes: Sequence[int]) -> int:
        """Prompt tokens the worker would serve from its cache: the leading run of hits."""
        held = self._hashes.get(worker)
        if not held:
            return 0
        num = 0
        for block_hash in block_hashes:
            if block_hash not in held:
                break
            num += 1
        return num * self.block_size
