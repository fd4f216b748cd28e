"""Per-request block tables on top of the block pool, with prefix-cache lookups."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from engine.core.block_pool import Block, BlockPool, chain_hash
from engine.wire import KVEvents


@dataclass
class PrefixCacheStats:
    """Prompt tokens looked up in and served from the prefix cache."""

    query_tokens: int = 0
    hit_tokens: int = 0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Maps request ids to their blocks; every block a request holds is in exactly one table."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.stats = PrefixCacheStats()
        self._tables: dict[str, list[Block]] = {}
        self._hashes: dict[str, list[int]] = {}  # chain hashes of the request's full blocks
        # Each table's block ids as the tuple a batch carries, rebuilt only when it grows.
        self._block_tables: dict[str, tuple[int, ...]] = {}
        self._block_tables_view = MappingProxyType(self._block_tables)

    @property
    def enable_caching(self) -> bool:
        return self.pool.enable_caching

    @property
    def num_blocks_in_use(self) -> int:
        return self.pool.num_used_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def holds(self, req_id: str) -> bool:
        return req_id in self._tables

    def block_ids(self, req_id: str) -> list[int]:
        return [b.block_id for b in self._tables.get(req_id, ())]

    def block_table(self, req_id: str) -> tuple[int, ...]:
        """The request's block ids in order (the same tuple until its table changes)."""
        return self._block_tables.get(req_id, ())

    @property
    def block_tables(self) -> Mapping[str, tuple[int, ...]]:
        """Every request's block ids, read-only: the scheduler reads them for every
        running request every step, where a lookup costs less than a call."""
        return self._block_tables_view

    def find_cached_prefix(
        self, token_ids: Sequence[int], block_hashes: list[int] | None = None
    ) -> list[Block]:
        """Longest run of cached full blocks matching the tokens.

        At least one token is always left to compute: the runner needs a query
        to produce the next token's logits. `block_hashes` (chain hashes of the
        tokens' first full blocks) is extended in place as far as the lookup goes,
        so a caller that keeps it hashes each block once, however often it asks.
        """
        if not self.enable_caching:
            return []
        hits: list[Block] = []
        hashes = [] if block_hashes is None else block_hashes
        max_blocks = (len(token_ids) - 1) // self.block_size
        for i in range(max_blocks):
            chunk = token_ids[i * self.block_size : (i + 1) * self.block_size]
            if i == len(hashes):
                hashes.append(chain_hash(hashes[-1] if hashes else None, chunk))
            block = self.pool.lookup(hashes[i], chunk)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate_slots(
        self,
        req_id: str,
        num_computed_tokens: int,
        num_new_tokens: int,
        cached_prefix: Sequence[Block] = (),
    ) -> list[int] | None:
        """Blocks so the request can hold `num_computed + num_new` tokens; None if they don't fit.

        `cached_prefix` (from find_cached_prefix, only when the request holds no blocks yet)
        is shared, not copied. On None nothing changes.
        """
        table = self._tables.get(req_id)
        num_needed = -(-(num_computed_tokens + num_new_tokens) // self.block_size)
        if table is not None and not cached_prefix and num_needed <= len(table):
            return []  # most decode steps: the table already has room (checked first)
        table = table or []
        if cached_prefix and table:
            raise ValueError(f"request {req_id} already holds blocks; no prefix to attach")
        num_new_blocks = num_needed - len(table) - len(cached_prefix)
        # A revived cached block leaves the free queue too, so it counts against what is free.
        num_revived = sum(1 for b in cached_prefix if b.ref_cnt == 0)
        if num_new_blocks + num_revived > self.pool.num_free_blocks:
            return None
        self.pool.touch(cached_prefix)
        fresh = self.pool.allocate(max(num_new_blocks, 0)) or []
        added = [*cached_prefix, *fresh]
        self._tables[req_id] = [*table, *added]
        # The ids so far stay (a decode step adds one block to a long table).
        ids = self._block_tables.get(req_id, ())
        self._block_tables[req_id] = ids + tuple(b.block_id for b in added)
        if cached_prefix:
            # Hits are cached blocks, so their chain hashes are known already.
            self._hashes[req_id] = [b.block_hash for b in cached_prefix if b.block_hash is not None]
        return [b.block_id for b in fresh]

    def take_kv_events(self) -> KVEvents:
        """Prefix-cache hashes stored and evicted since the last call (a snapshot at first)."""
        return self.pool.take_events()

    def record_prefix_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count a new request's prompt lookup for the hit-rate metric."""
        self.stats.query_tokens += num_query_tokens
        self.stats.hit_tokens += num_hit_tokens

    def cache_full_blocks(self, req_id: str, token_ids: Sequence[int], num_computed: int) -> None:
        """Register the request's newly completed full blocks in the prefix cache."""
        num_full = num_computed // self.block_size
        hashes = self._hashes.get(req_id)
        if hashes is not None and len(hashes) >= num_full:
            return  # most steps: no block completed (checked first: runs per request per step)
        table = self._tables.get(req_id)
        if table is None or not self.pool.enable_caching:
            return
        if hashes is None:
            hashes = self._hashes[req_id] = []
        num_full = min(num_full, len(table))
        for i in range(len(hashes), num_full):
            chunk = token_ids[i * self.block_size : (i + 1) * self.block_size]
            block_hash = chain_hash(hashes[-1] if hashes else None, chunk)
            hashes.append(block_hash)
            self.pool.cache(table[i], block_hash, chunk)

    def free_tail(self, req_id: str, num_tokens: int) -> None:
        """Return the blocks past the first `num_tokens` tokens (slots a verifying step
        took for proposals it rejected). Never cached: only computed blocks are."""
        table = self._tables.get(req_id)
        keep = cdiv(num_tokens, self.block_size)
        if table is None or len(table) <= keep:
            return
        tail = table[keep:]
        del table[keep:]
        self._block_tables[req_id] = tuple(b.block_id for b in table)
        self.pool.free(reversed(tail))

    def free(self, req_id: str) -> None:
        """Return the request's blocks; idempotent. Tail blocks go first into the
        eviction queue so a shared prefix outlives the suffixes that extend it."""
        table = self._tables.pop(req_id, None)
        self._hashes.pop(req_id, None)
        self._block_tables.pop(req_id, None)
        if table:
            self.pool.free(reversed(table))
