"""The router tier's admission: one budget of running and waiting requests over every
router process (here two, in one event loop, over one table)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

from engine.core.waiting_queue import QueuePolicy
from router.serving.errors import QueueFullError
from router.tier.shared_admission import AdmissionTable, SharedAdmission


def two_processes(
    tmp_path: Path, max_in_flight: int, max_queue: int, policy: QueuePolicy = "fcfs"
) -> tuple[SharedAdmission, SharedAdmission]:
    path = str(tmp_path / "admission")
    owner = AdmissionTable(path, 2, create=True)
    other = AdmissionTable(path, 2)  # as another process maps it
    return (
        SharedAdmission(owner, 0, max_in_flight, max_queue, policy=policy),
        SharedAdmission(other, 1, max_in_flight, max_queue, policy=policy),
    )


def test_the_limit_holds_for_the_tier_and_a_slot_freed_in_one_goes_to_the_other(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        a, b = two_processes(tmp_path, max_in_flight=2, max_queue=1)
        order: list[str] = []
        release = asyncio.Event()

        async def hold(adm: SharedAdmission, name: str) -> None:
            async with adm.slot():
                order.append(name)
                await release.wait()

        first = [asyncio.ensure_future(hold(a, "a1")), asyncio.ensure_future(hold(b, "b1"))]
        await asyncio.sleep(0.01)
        assert a.num_in_flight == b.num_in_flight == 2
        waiting = asyncio.ensure_future(hold(b, "b2"))
        await asyncio.sleep(0.01)
        assert a.num_queued == 1
        with pytest.raises(QueueFullError):  # the tier's queue is full, not a's
            async with a.slot():
                pass
        release.set()
        await asyncio.gather(*first, waiting)
        assert order == ["a1", "b1", "b2"]
        assert a.num_in_flight == 0 and a.num_queued == 0

    asyncio.run(main())


def test_the_most_urgent_waiter_of_the_tier_goes_first(tmp_path: Path) -> None:
    async def main() -> None:
        a, b = two_processes(tmp_path, max_in_flight=1, max_queue=8, policy="priority")
        order: list[str] = []
        gate = asyncio.Event()

        async def run(adm: SharedAdmission, name: str, priority: int) -> None:
            async with adm.slot(priority=priority):
                order.append(name)
                if name == "first":
                    await gate.wait()

        holder = asyncio.ensure_future(run(a, "first", 0))
        await asyncio.sleep(0.01)
        low = asyncio.ensure_future(run(a, "low", 5))
        await asyncio.sleep(0.01)
        high = asyncio.ensure_future(run(b, "high", 1))
        await asyncio.sleep(0.01)
        gate.set()
        await asyncio.gather(holder, low, high)
        assert order == ["first", "high", "low"]

    asyncio.run(main())


def test_a_restarted_process_row_starts_empty(tmp_path: Path) -> None:
    async def main() -> None:
        a, b = two_processes(tmp_path, max_in_flight=1, max_queue=0)
        cm = b.slot()
        await cm.__aenter__()
        assert a.num_in_flight == 1
        a.table.clear(1)  # the owner, as process 1 died with its slot
        assert a.num_in_flight == 0
        async with a.slot():
            pass
        with contextlib.suppress(Exception):
            await cm.__aexit__(None, None, None)

    asyncio.run(main())
