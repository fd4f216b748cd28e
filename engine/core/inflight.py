"""Batches the scheduler handed out whose results it has not applied yet.

With scheduling one step ahead (engine.core.engine_core) one batch is in flight while
the next is scheduled. Each batch is kept with the requests it was built for, so its
results reach those objects even if an id was aborted and reused meanwhile. A batch
that the caller abandoned (scheduled only to look at it) is rolled back: its tokens are
scheduled again.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from engine.core.batch import Batch
from engine.core.request import Request, RequestStatus


class InflightBatches:
    """Handed-out batches, oldest first, at most `max_in_flight` kept past a schedule()."""

    def __init__(self, max_in_flight: int) -> None:
        self.max_in_flight = max_in_flight
        self._batches: deque[tuple[Batch, tuple[Request, ...]]] = deque()

    def add(self, batch: Batch, reqs: tuple[Request, ...]) -> None:
        self._batches.append((batch, reqs))

    def roll_back_abandoned(self) -> None:
        """Forget batches beyond the ones that may still be updated (schedule() calls it)."""
        while len(self._batches) > self.max_in_flight:
            batch, reqs = self._batches.popleft()
            for seq, req in zip(batch.seqs, reqs, strict=True):
                if req.status is RequestStatus.RUNNING:
                    req.num_inflight_tokens -= len(seq.token_ids)
                    if seq.sample:
                        req.drop_placeholders()

    def requests_of(
        self, batch: Batch, lookup: Callable[[str], Request | None]
    ) -> tuple[Request | None, ...]:
        """The requests `batch` was built for (update() takes it out of flight)."""
        while self._batches:
            scheduled, reqs = self._batches.popleft()
            if scheduled is batch:
                return reqs
        # Not one of ours (built by hand): look the ids up.
        return tuple(lookup(s.req_id) for s in batch.seqs)
