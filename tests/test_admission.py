"""Router admission: bounded in-flight and queue, fcfs or priority order with aging."""

from __future__ import annotations

import asyncio

import pytest

from router.serving.admission import Admission
from router.serving.errors import QueueFullError


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def admit_all(adm: Admission, requests: list[tuple[str, int]]) -> list[str]:
    """Hold the only slot, queue `requests` (name, priority), then release it; returns
    the order in which the queued requests got their slot."""
    order: list[str] = []
    holder_release = asyncio.Event()

    async def holder() -> None:
        async with adm.slot():
            await holder_release.wait()

    async def one(name: str, priority: int) -> None:
        async with adm.slot(priority):
            order.append(name)
            await asyncio.sleep(0)

    h = asyncio.create_task(holder())
    await asyncio.sleep(0)
    tasks = []
    for name, prio in requests:
        tasks.append(asyncio.create_task(one(name, prio)))
        await asyncio.sleep(0)
    holder_release.set()
    await asyncio.gather(h, *tasks)
    assert adm.num_in_flight == 0 and adm.num_queued == 0
    return order


def test_fcfs_by_default_ignores_priority() -> None:
    adm = Admission(1, 10)
    order = asyncio.run(admit_all(adm, [("a", 5), ("b", 0), ("c", 1)]))
    assert order == ["a", "b", "c"]


def test_priority_order_serves_the_most_urgent_first() -> None:
    adm = Admission(1, 10, policy="priority")
    order = asyncio.run(admit_all(adm, [("a", 5), ("b", 0), ("c", 1), ("d", 0)]))
    assert order == ["b", "d", "c", "a"]


def test_aging_promotes_a_long_waiter() -> None:
    clock = FakeClock()
    adm = Admission(1, 10, policy="priority", aging_s=10.0, clock=clock)

    async def main() -> list[str]:
        order: list[str] = []
        gate = asyncio.Event()

        async def holder() -> None:
            async with adm.slot():
                await gate.wait()

        async def one(name: str, priority: int) -> None:
            async with adm.slot(priority):
                order.append(name)

        h = asyncio.create_task(holder())
        await asyncio.sleep(0)
        old = asyncio.create_task(one("old", 4))
        await asyncio.sleep(0)
        clock.now = 31.0  # "old" earned three levels: effective 1
        new = asyncio.create_task(one("new", 2))
        await asyncio.sleep(0)
        gate.set()
        await asyncio.gather(h, old, new)
        return order

    assert asyncio.run(main()) == ["old", "new"]


def test_queue_full_is_refused_and_cancelled_waiters_leave() -> None:
    async def main() -> None:
        adm = Admission(1, 1, policy="priority")
        gate = asyncio.Event()

        async def hold(priority: int = 0) -> None:
            async with adm.slot(priority):
                await gate.wait()

        h = asyncio.create_task(hold())
        await asyncio.sleep(0)
        queued = asyncio.create_task(hold())
        await asyncio.sleep(0)
        with pytest.raises(QueueFullError):
            async with adm.slot():
                pass
        queued.cancel()
        await asyncio.sleep(0)
        assert adm.num_queued == 0
        gate.set()
        await h
        assert adm.num_in_flight == 0
        async with adm.slot():
            assert adm.num_in_flight == 1

    asyncio.run(main())


def test_rejects_unknown_policy() -> None:
    with pytest.raises(ValueError, match="'fcfs' or 'priority'"):
        Admission(1, 1, policy="lifo")  # type: ignore[arg-type]
