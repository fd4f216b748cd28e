"""KV events (`engine.wire.KVEvents`): which full-block chain hashes a prefix cache gained
and lost.

A router that knows these can send a prompt to the worker already holding its
prefix. Events are buffered as a net state per hash (present or gone), so a batch
can be applied in any order and a hash stored and evicted within one batch is
reported once, as what it ended as.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.wire import KVEvents


class KVEventBuffer:
    """Collects store/evict notices between drains, bounded in memory.

    Past `max_pending` distinct hashes the delta is dropped and the next drain
    returns a snapshot instead, so an engine nobody drains never grows without bound.
    """

    def __init__(self, max_pending: int) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.max_pending = max_pending
        self._pending: dict[int, bool] = {}  # hash -> present after the last change
        self._needs_snapshot = True

    def stored(self, block_hash: int) -> None:
        self._note(block_hash, True)

    def removed(self, block_hash: int) -> None:
        self._note(block_hash, False)

    def _note(self, block_hash: int, present: bool) -> None:
        if self._needs_snapshot:
            return  # the next drain is a snapshot anyway
        self._pending[block_hash] = present
        if len(self._pending) > self.max_pending:
            self._pending.clear()
            self._needs_snapshot = True

    def take(self, cached_hashes: Iterable[int]) -> KVEvents:
        """Drain: the delta since the last take, or a snapshot of `cached_hashes`."""
        if self._needs_snapshot:
            self._needs_snapshot = False
            self._pending.clear()
            return KVEvents(stored=tuple(cached_hashes), full=True)
        stored = tuple(h for h, present in self._pending.items() if present)
        removed = tuple(h for h, present in self._pending.items() if not present)
        self._pending.clear()
        return KVEvents(stored=stored, removed=removed)
