"""MigrateRequests and drains across a router tier: every process's requests on the
worker move.

Each router process carries its own requests, so only it can move them (it holds their
streams). The owner answers MigrateRequests wherever the call landed (admin_proxy.py):
with a limit it first asks every process for the token budgets of its requests on the
worker, picks the service's largest (`shares`), then has each process move its share
with their KV, as it moves its own (router/serving/live_migration.py), and sums what
they report. A drain has every process move all of its requests off the worker, and the
owner keeps the worker and its channels until each has answered: a process's requests
leave the worker's queues at their detach, before their KV is sent. A process that does
not answer in time, or exits, counts as having moved nothing.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from router.serving.live_migration import MoveResult
from router.tier.messages import Rebalance, Rebalanced

if TYPE_CHECKING:
    from router.fleet.worker_ref import WorkerRef

log = logging.getLogger(__name__)

BUDGETS_WAIT_S = 5.0  # an answer from memory: seconds mean the process is stuck
MOVE_WAIT_S = 120.0  # as long as a move of its requests may take
ALIVE_CHECK_S = 0.5  # how often a wait for answers looks for processes that exited


def shares(budgets: Mapping[int, list[int]], max_requests: int | None) -> dict[int, int]:
    """How many requests each process (by index) moves so that, together, they move the
    `max_requests` largest budgets of the service (None: every request)."""
    if max_requests is None:
        return {index: len(b) for index, b in budgets.items()}
    everyone = sorted(
        ((budget, index) for index, b in budgets.items() for budget in b), reverse=True
    )
    counts = dict.fromkeys(budgets, 0)
    for _, index in everyone[:max_requests]:
        counts[index] += 1
    return counts


class Mover(Protocol):
    """A process's live migration (router.serving.live_migration.LiveMigrator)."""

    def budgets(self, source: WorkerRef) -> list[int]: ...
    async def rebalance(self, source: WorkerRef, max_requests: int | None) -> MoveResult: ...
    async def drain(self, source: WorkerRef) -> MoveResult: ...


class TierLine(Protocol):
    """The owner's line to the other processes (router.tier.owner.TierOwner)."""

    on_rebalanced: Callable[[int, Rebalanced], None] | None

    def connected(self) -> list[int]: ...
    def pids(self) -> dict[int, int]: ...
    def tell_one(self, message: Any, index: int) -> bool: ...


class TierRebalancer:
    """The owner's MigrateRequests over every router process (process 0 is the owner)."""

    def __init__(
        self,
        local: Mover,
        tier: TierLine,
        budgets_wait_s: float = BUDGETS_WAIT_S,
        move_wait_s: float = MOVE_WAIT_S,
    ) -> None:
        self.local = local
        self.tier = tier
        self.budgets_wait_s = budgets_wait_s
        self.move_wait_s = move_wait_s
        self._seq = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[Rebalanced]] = {}
        tier.on_rebalanced = self._answered

    async def rebalance(self, source: WorkerRef, max_requests: int | None) -> MoveResult:
        others = self.tier.connected()
        budgets: dict[int, list[int]] = {0: self.local.budgets(source)}
        if max_requests is None:
            counts: dict[int, int | None] = {index: None for index in (0, *others)}
        else:
            answers = await self._ask(others, source, None, True, self.budgets_wait_s)
            budgets.update({i: list(a.budgets) for i, a in answers.items()})
            counts = {i: n for i, n in shares(budgets, max_requests).items() if n}
        remote = {i: n for i, n in counts.items() if i != 0}
        mine = counts.get(0, 0)
        local_move = self.local.rebalance(source, mine) if mine != 0 else _nothing_moved()
        moved_here, answers = await asyncio.gather(
            local_move, self._ask_counts(remote, source, self.move_wait_s)
        )
        return _summed([moved_here, *(_as_result(a) for a in answers.values())])

    async def drain_others(self, source: WorkerRef) -> MoveResult:
        """Every other process moves all its requests off the draining `source`; returns
        once each has answered (or exited, or the wait is over): what they moved."""
        answers = await self._ask(
            self.tier.connected(), source, None, False, self.move_wait_s, drain=True
        )
        return _summed([_as_result(a) for a in answers.values()])

    async def _ask_counts(
        self, counts: Mapping[int, int | None], source: WorkerRef, timeout_s: float
    ) -> dict[int, Rebalanced]:
        asked = await asyncio.gather(
            *(self._ask([i], source, n, False, timeout_s) for i, n in counts.items())
        )
        return {i: a for answer in asked for i, a in answer.items()}

    async def _ask(
        self,
        indexes: list[int],
        source: WorkerRef,
        count: int | None,
        budgets_only: bool,
        timeout_s: float,
        drain: bool = False,
    ) -> dict[int, Rebalanced]:
        """Each process's answer to one `Rebalance`; those that did not answer (in time,
        or before they exited) left out."""
        loop = asyncio.get_running_loop()
        futures: dict[int, asyncio.Future[Rebalanced]] = {}
        pids = self.tier.pids()
        for index in indexes:
            seq = next(self._seq)
            message = Rebalance(
                seq, source.worker_id, source.info.epoch, count, budgets_only, drain
            )
            if self.tier.tell_one(message, index):
                futures[index] = self._waiting[seq] = loop.create_future()
        deadline = loop.time() + timeout_s
        try:
            while loop.time() < deadline:
                # A process that exited (or was started again) will not answer.
                alive = self.tier.pids()
                pending = [
                    f
                    for i, f in futures.items()
                    if not f.done() and pids.get(i) is not None and alive.get(i) == pids.get(i)
                ]
                if not pending:
                    break
                wait_s = min(ALIVE_CHECK_S, deadline - loop.time())
                await asyncio.wait(pending, timeout=wait_s)
        finally:
            for seq in [s for s, f in self._waiting.items() if f in futures.values()]:
                del self._waiting[seq]
        late = sorted(i for i, f in futures.items() if not f.done())
        if late:
            log.warning(
                "router processes %s did not answer a move off %s (exited, or not in %.0f s)",
                late,
                source.worker_id,
                timeout_s,
            )
        return {i: f.result() for i, f in futures.items() if f.done()}

    def _answered(self, index: int, message: Rebalanced) -> None:
        answer = self._waiting.get(message.seq)
        if answer is not None and not answer.done():
            answer.set_result(message)


async def _nothing_moved() -> MoveResult:
    return MoveResult(0, 0, 0)


def _summed(results: list[MoveResult]) -> MoveResult:
    return MoveResult(
        sum(r.num_candidates for r in results),
        sum(r.with_kv for r in results),
        sum(r.by_recompute for r in results),
    )


def _as_result(answer: Rebalanced) -> MoveResult:
    return MoveResult(answer.num_candidates, answer.with_kv, answer.by_recompute)


async def answer_rebalance(
    asked: Rebalance,
    find: Callable[[str, int], WorkerRef | None],
    mover: Mover | None,
    send: Callable[[Any], None],
) -> None:
    """A router process's side: report its budgets on the worker, or move its share."""
    source = find(asked.worker_id, asked.epoch)
    if source is None or mover is None:
        send(Rebalanced(asked.seq))
    elif asked.budgets_only:
        send(Rebalanced(asked.seq, budgets=tuple(mover.budgets(source))))
    else:
        try:
            if asked.drain:
                result = await mover.drain(source)
            else:
                result = await mover.rebalance(source, asked.count)
        except Exception:
            log.exception("moving requests off %s failed", asked.worker_id)
            result = MoveResult(0, 0, 0)
        send(Rebalanced(asked.seq, (), result.num_candidates, result.with_kv, result.by_recompute))
