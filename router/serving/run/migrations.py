"""Migration: a request whose token-producing worker is lost after the client saw tokens
moves to another worker and goes on from there.

The new attempt's prompt is the original prompt plus every token already streamed, and
it asks for the tokens still to come (`router.serving.run.attempts.continuation`). The sampler's
randomness is a function of (seed, absolute position), and the continuation's positions
are the original ones, so greedy and seeded requests give the text an undisturbed run
gives; the router's detokenizer and stop-string matcher simply go on, having seen every
streamed token. `--max-migrations` bounds the moves per request (0: a request whose
worker is lost after its first token ends with an error, as before migration existed).

Each migration is logged here; the serving core's observers count it
(router/observability/serving_metrics.py).
"""

from __future__ import annotations

import logging

from engine.wire import PoolName
from router.serving.run.attempts import Progress, WorkerLost
from router.serving.workers import WorkerRef

log = logging.getLogger(__name__)


MIGRATION_POOLS = (PoolName.DECODE, PoolName.COLOCATED)
MIGRATION_REASONS = ("worker_died", "drained", "drained_kv", "rebalanced", "rebalanced_kv")


class MigrationLimitError(RuntimeError):
    """The request's worker was lost and it may not move again: its terminal error."""


def migrates(
    request_id: str, lost: WorkerLost, progress: Progress, max_migrations: int
) -> WorkerRef | None:
    """The worker the request migrates off, when the lost attempt's next one is a
    migration: its token-producing worker is gone after the client saw tokens (recorded
    in `progress`, logged); else None. MigrationLimitError (the request's terminal
    error) when it may not move again."""
    worker = lost.worker
    if worker is None or worker.pool not in MIGRATION_POOLS or not progress.num_out:
        return None
    num_streamed, num_done = progress.num_out, progress.num_migrations
    if num_done >= max_migrations:
        limit = (
            "migration is off (--max-migrations 0)"
            if max_migrations == 0
            else f"it already moved {num_done} times (--max-migrations {max_migrations})"
        )
        raise MigrationLimitError(
            f"{worker.worker_id} was lost after {num_streamed} tokens ({lost}); {limit}"
        )
    log.warning(
        "request %s migrates off %s after %d tokens (%s): migration %d of at most %d",
        request_id,
        worker.worker_id,
        num_streamed,
        lost,
        num_done + 1,
        max_migrations,
    )
    progress.num_migrations += 1
    progress.num_resumed += 1
    return worker
