"""Migration: a request whose token-producing worker is lost after the client saw tokens
moves to another worker and goes on from there.

The new attempt's prompt is the original prompt plus every token already streamed, and
it asks for the tokens still to come (`router.serving.attempts.continuation`). The sampler's
randomness is a function of (seed, absolute position), and the continuation's positions
are the original ones, so greedy and seeded requests give the text an undisturbed run
gives; the router's detokenizer and stop-string matcher simply go on, having seen every
streamed token. `--max-migrations` bounds the moves per request (0: a request whose
worker is lost after its first token ends with an error, as before migration existed).

Each migration is logged and counted in `pdserve_request_migrations_total{pool, reason}`
(reason: `worker_died`; `drained_kv` for a request that moved off a draining decode worker
with its KV, router/serving/live_migration.py, and `drained` for one that could not and moved by
recompute; `rebalanced_kv` and `rebalanced` the same for a move an operator asked for,
`MigrateRequests`).
"""

from __future__ import annotations

import logging
import threading

from prometheus_client import CollectorRegistry, Counter

from engine.wire import PoolName
from router.observability import metrics
from router.serving.attempts import Progress, WorkerLost

log = logging.getLogger(__name__)

MIGRATION_POOLS = (PoolName.DECODE, PoolName.COLOCATED)
MIGRATION_REASONS = ("worker_died", "drained", "drained_kv", "rebalanced", "rebalanced_kv")

_counters: dict[int, Counter] = {}
_lock = threading.Lock()


def migrations_counter(registry: CollectorRegistry | None = None) -> Counter:
    """The migrations counter in `registry` (the router's own by default), registered on
    first use with every (pool, reason) series at zero."""
    registry = registry or metrics.get_metrics().registry
    with _lock:
        counter = _counters.get(id(registry))
        if counter is None:
            counter = Counter(
                "pdserve_request_migrations",
                "Requests moved to another worker after tokens were streamed, by the pool "
                "of the worker they left and why they left it.",
                ["pool", "reason"],
                registry=registry,
            )
            for pool in MIGRATION_POOLS:
                for reason in MIGRATION_REASONS:
                    counter.labels(pool=pool, reason=reason)
            _counters[id(registry)] = counter
        return counter


class MigrationLimitError(RuntimeError):
    """The request's worker was lost and it may not move again: its terminal error."""


def migrate(
    request_id: str,
    *,
    worker_id: str,
    pool: str,
    reason: str,
    cause: str,
    num_streamed: int,
    num_done: int,
    max_migrations: int,
) -> None:
    """Record migration number `num_done + 1` of a request (log line, metric), or raise
    MigrationLimitError when `max_migrations` are spent."""
    if num_done >= max_migrations:
        limit = (
            "migration is off (--max-migrations 0)"
            if max_migrations == 0
            else f"it already moved {num_done} times (--max-migrations {max_migrations})"
        )
        raise MigrationLimitError(
            f"{worker_id} was lost after {num_streamed} tokens ({cause}); {limit}"
        )
    migrations_counter().labels(pool=pool, reason=reason).inc()
    log.warning(
        "request %s migrates off %s after %d tokens (%s): migration %d of at most %d",
        request_id,
        worker_id,
        num_streamed,
        cause,
        num_done + 1,
        max_migrations,
    )


def migrates(request_id: str, lost: WorkerLost, progress: Progress, max_migrations: int) -> bool:
    """True when the lost attempt's next one is a migration: its token-producing worker
    is gone after the client saw tokens (recorded in `progress`, logged, counted).
    MigrationLimitError (the request's terminal error) when it may not move again."""
    worker = lost.worker
    if worker is None or worker.pool not in MIGRATION_POOLS or not progress.num_out:
        return False
    migrate(
        request_id,
        worker_id=worker.worker_id,
        pool=worker.pool,
        reason=lost.why,
        cause=str(lost),
        num_streamed=progress.num_out,
        num_done=progress.num_migrations,
        max_migrations=max_migrations,
    )
    progress.num_migrations += 1
    progress.num_resumed += 1
    return True
