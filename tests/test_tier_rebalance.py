"""MigrateRequests and drains across a router tier: the owner sums every process's
moves, a limit picks the service's largest budgets, wherever their streams are, and a
drain waits for every process that can still answer."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from engine.wire import KVLayout, PoolName, WorkerInfo
from router.fleet.worker_ref import WorkerRef
from router.serving.live_migration import MoveResult
from router.tier.messages import Rebalance, Rebalanced
from router.tier.rebalance import TierRebalancer, answer_rebalance, shares


def test_shares_pick_the_largest_budgets_of_the_whole_service() -> None:
    budgets = {0: [100, 10], 1: [90, 80, 5], 2: []}
    assert shares(budgets, 3) == {0: 1, 1: 2, 2: 0}
    assert shares(budgets, 1) == {0: 1, 1: 0, 2: 0}
    assert shares(budgets, None) == {0: 2, 1: 3, 2: 0}
    assert shares(budgets, 50) == {0: 2, 1: 3, 2: 0}


_REF = WorkerRef(
    PoolName.DECODE,
    0,
    None,
    WorkerInfo(
        "decode-0",
        "decode",
        0,
        7,
        KVLayout("m", "float32", 16, 2, 2, 8),
        64,
        512,
        100,
        "m",
        "cpu",
        1,
        "x",
    ),
)


def _ref() -> WorkerRef:
    return _REF


class _Mover:
    """A process's live migration: its requests' budgets on the worker, moved on ask."""

    def __init__(self, budgets: list[int], move_s: float = 0.0) -> None:
        self._budgets = budgets
        self.move_s = move_s  # how long a drain's moves take
        self.asked: list[int | None] = []
        self.drained = 0

    def budgets(self, source: WorkerRef) -> list[int]:
        return list(self._budgets)

    async def rebalance(self, source: WorkerRef, max_requests: int | None) -> MoveResult:
        self.asked.append(max_requests)
        n = len(self._budgets[:max_requests])
        return MoveResult(n, n, 0)

    async def drain(self, source: WorkerRef) -> MoveResult:
        await asyncio.sleep(self.move_s)
        self.drained += 1
        n = len(self._budgets)
        return MoveResult(n, n - 1, 1)  # one request not running: by recompute


class _Tier:
    """The owner's line to processes 1 and 2, each answering with its own mover; process
    3 is on the line but never answers."""

    def __init__(self, movers: dict[int, _Mover]) -> None:
        self.movers = movers
        self.on_rebalanced: Callable[[int, Rebalanced], None] | None = None
        self.told: list[tuple[int, Rebalance]] = []
        self.running = {index: 1000 + index for index in (*movers, 3)}  # index → pid

    def connected(self) -> list[int]:
        return [*self.movers, 3]

    def pids(self) -> dict[int, int]:
        return dict(self.running)

    def tell_one(self, message: Any, index: int) -> bool:
        assert isinstance(message, Rebalance)
        self.told.append((index, message))
        if index in self.movers:

            def send(answer: Any) -> None:
                assert self.on_rebalanced is not None
                self.on_rebalanced(index, answer)

            mover = self.movers[index]
            asyncio.ensure_future(answer_rebalance(message, lambda w, e: _ref(), mover, send))
        return True


def _rebalance(max_requests: int | None) -> tuple[MoveResult, _Mover, _Tier]:
    local = _Mover([50, 40])
    tier = _Tier({1: _Mover([60, 30]), 2: _Mover([45])})
    rebalancer = TierRebalancer(local, tier, budgets_wait_s=0.2, move_wait_s=0.2)
    return asyncio.run(rebalancer.rebalance(_ref(), max_requests)), local, tier


def test_a_limit_moves_the_services_largest_requests_from_each_process() -> None:
    result, local, tier = _rebalance(3)
    # 60 (process 1), 50 (the owner), 45 (process 2): one each.
    assert result == MoveResult(3, 3, 0)
    assert local.asked == [1]
    assert tier.movers[1].asked == [1] and tier.movers[2].asked == [1]


def test_no_limit_moves_every_processs_requests_and_a_silent_process_counts_nothing() -> None:
    result, local, tier = _rebalance(None)
    assert result == MoveResult(5, 5, 0)
    assert local.asked == [None]
    assert tier.movers[1].asked == [None] and tier.movers[2].asked == [None]
    assert {index for index, _ in tier.told} == {1, 2, 3}


def test_a_drain_returns_once_every_process_has_moved_its_requests_off() -> None:
    """The owner keeps a draining worker (and its channels) until each process answers
    that its moves are over; a process that exits meanwhile is not waited for."""
    slow = _Mover([10, 20, 30], move_s=0.3)
    tier = _Tier({1: slow, 2: _Mover([5, 6])})
    rebalancer = TierRebalancer(_Mover([]), tier, move_wait_s=30)

    async def drain() -> tuple[MoveResult, float]:
        started = time.monotonic()
        # Process 3 never answers: it exits while the others move theirs.
        asyncio.get_running_loop().call_later(0.1, tier.running.pop, 3)
        result = await rebalancer.drain_others(_ref())
        return result, time.monotonic() - started

    result, took = asyncio.run(drain())
    assert result == MoveResult(5, 3, 2)
    assert slow.drained == 1 and tier.movers[2].drained == 1
    assert all(m.drain and m.count is None for _, m in tier.told)
    assert 0.3 <= took < 5.0, took  # after the slowest answer; not the 30 s wait
