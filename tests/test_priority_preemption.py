"""Priority policy: an urgent request preempts the least urgent running one when there
is no room, and waiting time ages a request's priority so nothing starves."""

from __future__ import annotations

import pytest

from engine.core.config import SchedulerConfig
from engine.core.engine_core import EngineCore
from engine.core.request import RequestStatus
from engine.core.waiting_queue import QueuePolicy
from tests.fakes import add, expected_output, make_engine, run_to_completion


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def with_clock(core: EngineCore) -> FakeClock:
    clock = FakeClock()
    core.scheduler.waiting.aging.clock = clock
    return clock


def scheduled(core: EngineCore) -> set[str]:
    return {s.req_id for s in core.scheduler.schedule().seqs}


def prompt_of(core: EngineCore, req_id: str) -> list[int]:
    return list(core.scheduler.requests[req_id].prompt_token_ids)


def test_an_urgent_request_overtakes_a_full_batch() -> None:
    core, _ = make_engine(max_num_seqs=3, policy="priority")
    for i in range(3):
        add(core, f"bulk{i}", 8, 30, priority=5)
    first = {u.req_id: list(u.new_token_ids) for u in core.step()}
    prompts = {r: prompt_of(core, r) for r in core.scheduler.requests}
    add(core, "urgent", 8, 5, priority=0)
    prompts["urgent"] = prompt_of(core, "urgent")
    assert "urgent" in scheduled(core)
    victims = [r.req_id for r in core.scheduler.waiting]
    assert victims == ["bulk2"]  # least urgent, then latest arrival
    assert core.scheduler.num_running == 3
    outputs = run_to_completion(core)
    for req_id, tokens in first.items():
        outputs[req_id] = tokens + outputs[req_id]
    assert outputs["urgent"] == expected_output(prompts["urgent"], 5)
    for req_id in ("bulk0", "bulk1", "bulk2"):  # the victim recomputes, same tokens
        assert outputs[req_id] == expected_output(prompts[req_id], 30)
    assert core.scheduler.kv.num_blocks_in_use == 0


def test_an_urgent_request_preempts_when_blocks_run_out() -> None:
    core, _ = make_engine(num_blocks=8, block_size=4, policy="priority")
    add(core, "bulk0", 12, 4, priority=3)  # 4 blocks each once decoding
    add(core, "bulk1", 12, 4, priority=3)
    core.step()
    add(core, "urgent", 12, 4, priority=1)
    assert "urgent" in scheduled(core)
    assert [r.req_id for r in core.scheduler.waiting] == ["bulk1"]
    run_to_completion(core)
    assert core.scheduler.kv.num_blocks_in_use == 0


def test_equal_priority_and_fcfs_never_preempt_for_a_newcomer() -> None:
    cases: tuple[tuple[QueuePolicy, int], ...] = (("priority", 5), ("fcfs", 0))
    for policy, prio in cases:
        core, _ = make_engine(max_num_seqs=2, policy=policy)
        add(core, "a", 8, 30, priority=5)
        add(core, "b", 8, 30, priority=5)
        core.step()
        add(core, "c", 8, 5, priority=prio)
        assert scheduled(core) == {"a", "b"}
        assert all(r.num_preemptions == 0 for r in core.scheduler.requests.values())


def test_aging_lets_a_waiting_request_overtake_newer_urgent_ones() -> None:
    core, _ = make_engine(max_num_seqs=1, policy="priority", priority_aging_s=10.0)
    clock = with_clock(core)
    add(core, "running", 8, 1000, priority=0)
    core.step()
    add(core, "patient", 8, 5, priority=3)
    clock.now = 25.0  # two levels earned: effective priority 1
    add(core, "fresh", 8, 5, priority=2)
    assert [r.req_id for r in core.scheduler.waiting] == ["patient", "fresh"]
    assert scheduled(core) == {"running"}  # 1 is not more urgent than 0: no preemption
    clock.now = 31.0  # effective priority 0: still not strictly more urgent
    assert scheduled(core) == {"running"}
    clock.now = 41.0  # effective priority -1: preempts the running request
    assert scheduled(core) == {"patient"}


def test_a_preempted_request_does_not_bounce_its_preemptor() -> None:
    core, _ = make_engine(max_num_seqs=1, policy="priority", priority_aging_s=10.0)
    clock = with_clock(core)
    clock.now = 100.0
    add(core, "low", 8, 1000, priority=4)
    core.step()  # "low" waited nothing: it ran at once
    add(core, "high", 8, 1000, priority=2)
    assert scheduled(core) == {"high"}
    # "low" waits again from effective priority 4; "high" runs at 2. Only after three
    # more levels (30 s) is "low" strictly more urgent.
    for t, expect in ((110.0, "high"), (125.0, "high"), (129.9, "high"), (130.0, "low")):
        clock.now = t
        assert scheduled(core) == {expect}
    low = core.scheduler.requests["low"]
    assert low.status is RequestStatus.RUNNING and low.num_preemptions == 1


def test_aging_off_keeps_static_order() -> None:
    core, _ = make_engine(max_num_seqs=1, policy="priority", priority_aging_s=0)
    clock = with_clock(core)
    add(core, "running", 8, 1000, priority=0)
    core.step()
    add(core, "patient", 8, 5, priority=3)
    clock.now = 1e6
    add(core, "fresh", 8, 5, priority=2)
    assert [r.req_id for r in core.scheduler.waiting] == ["fresh", "patient"]


def test_aging_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="priority_aging_s"):
        SchedulerConfig(policy="priority", priority_aging_s=-1)
