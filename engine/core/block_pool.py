"""Fixed-size KV blocks: ref counts, a free queue in eviction order, and the prefix cache.

Plain Python, no torch: the pool only hands out block ids; the model runner owns
the tensor those ids index.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from engine.core.kv_events import KVEventBuffer
from engine.wire import KVEvents

# Parent of the first block. Python hashes ints and tuples of ints the same in every
# process (None and str are not), so a router hashes a prompt exactly as the engine does.
ROOT_HASH = 0x5EED


def chain_hash(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Hash of a full block that also commits to every block before it."""
    return hash((ROOT_HASH if parent_hash is None else parent_hash, tuple(token_ids)))


def prefix_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chain hashes of the full blocks a prefix-cache lookup considers for a prompt.

    The last token is never served from the cache (its logits are needed), so a
    prompt of exactly k blocks yields k - 1 hashes: the same blocks
    KVCacheManager.find_cached_prefix can hit.
    """
    hashes: list[int] = []
    parent: int | None = None
    for i in range((len(token_ids) - 1) // block_size):
        parent = chain_hash(parent, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes


@dataclass
class Block:
    """One KV block; `block_hash`/`token_ids` are set while it holds a cached full block."""

    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None


class BlockPool:
    """Owns every block id. A block with ref_cnt 0 sits in the free queue; if it is
    still in the prefix cache it can be revived by a hit until it is evicted."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Front = evicted first. OrderedDict gives O(1) removal of a revived block.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[int, Block] = {}
        self._events = KVEventBuffer(max_pending=4 * num_blocks + 64)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def lookup(self, block_hash: int, token_ids: Sequence[int]) -> Block | None:
        """A cached block for this hash whose tokens really match (hash collisions are refused)."""
        if not self.enable_caching:
            return None
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on cache hits, pulling free ones out of the eviction queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def allocate(self, num_blocks: int) -> list[Block] | None:
        """Fresh blocks with ref_cnt 1, evicting cached ones as needed; None if too few are free."""
        if num_blocks > len(self._free):
            return None
        out: list[Block] = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference each; blocks reaching zero join the back of the free queue."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed more times than allocated")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = None

    def cache(self, block: Block, block_hash: int, token_ids: Sequence[int]) -> None:
        """Register a full, computed block in the prefix cache (first writer wins)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return  # an identical block is already cached; this one stays private
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self._cached[block_hash] = block
        self._events.stored(block_hash)

    def cached_hashes(self) -> tuple[int, ...]:
        """Every hash in the prefix cache now."""
        return tuple(self._cached)

    def take_events(self) -> KVEvents:
        """Prefix-cache hashes stored and evicted since the last call (a snapshot at first)."""
        return self._events.take(self._cached)

    def _evict(self, block: Block) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
                self._events.removed(block.block_hash)
            block.block_hash = None
            block.token_ids = None
