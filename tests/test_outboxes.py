"""A decode worker's outboxes per router process: each request's updates reach the
process that owns it, a gone process's requests are recorded for a take-over, and a
take-over switches a request between two updates without losing or repeating one."""

from __future__ import annotations

import asyncio

from decode_worker.outboxes import LOST_AFTER_S, Outboxes
from engine.core.request import FinishReason
from engine.sampling_params import SamplingParams
from engine.wire import GenerationInput, TokenUpdate


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def inp(req_id: str, consumer: str, request_id: str = "") -> GenerationInput:
    return GenerationInput(
        req_id, (1, 2, 3), SamplingParams(max_tokens=8), consumer=consumer, request_id=request_id
    )


def tokens(updates: list[TokenUpdate]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for u in updates:
        out.setdefault(u.req_id, []).extend(u.new_token_ids)
    return out


def test_without_named_consumers_every_update_goes_to_the_one_outbox() -> None:
    async def main() -> None:
        boxes = Outboxes()
        boxes.route([TokenUpdate("a", (5,)), TokenUpdate("b", (6,))])
        box = boxes.poll_started("", None)
        assert tokens(boxes.take(box)) == {"a": [5], "b": [6]}
        assert box.ready.is_set()

    asyncio.run(main())


def test_each_request_reaches_its_own_router_process() -> None:
    async def main() -> None:
        boxes = Outboxes()
        boxes.assign(inp("a", "r1"))
        boxes.assign(inp("b", "r2"))
        boxes.route([TokenUpdate("a", (5,)), TokenUpdate("b", (6,)), TokenUpdate("x", (7,))])
        r1, r2 = boxes.poll_started("r1", 30.0), boxes.poll_started("r2", 30.0)
        assert tokens(boxes.take(r1)) == {"a": [5]}
        assert tokens(boxes.take(r2)) == {"b": [6]}  # "x": nobody's, dropped
        # A finished request is forgotten: its id no longer finds it.
        boxes.route([TokenUpdate("a", (8,), FinishReason.LENGTH)])
        assert boxes.consumer_of("a") is None
        assert tokens(boxes.take(r1)) == {"a": [8]}

    asyncio.run(main())


def test_a_gone_router_processes_requests_are_recorded_and_handed_over() -> None:
    async def main() -> None:
        clock = Clock()
        boxes = Outboxes(clock)
        boxes.assign(inp("a", "r1", request_id="client-a"))
        boxes.assign(inp("b", "r1", request_id="client-b"))
        box = boxes.poll_started("r1", 20.0)
        boxes.poll_ended(box)
        boxes.route([TokenUpdate("a", (5,))])  # after its last poll: never delivered
        clock.now += LOST_AFTER_S + 1
        lost, expired = boxes.sweep()
        assert lost == ["r1"] and expired == []
        # Their tokens as read off the engine at a step boundary (b's KV has not landed).
        boxes.start_orphans({"a": (4, 5), "b": None})
        boxes.route([TokenUpdate("a", (6,)), TokenUpdate("b", (9,))])  # b's decode step...
        boxes.first_token("b", 8)  # ... after its first token, posted at its admission
        assert boxes.locate("client-a") == "a"
        handover = boxes.handover_now("a", "r2")
        assert handover is not None
        assert handover.output_token_ids == (4, 5, 6)
        assert handover.inp.consumer == "r2" and handover.finish_reason is None
        boxes.route([TokenUpdate("a", (7,))])
        r2 = boxes.poll_started("r2", 20.0)
        assert tokens(boxes.take(r2)) == {"a": [7]}  # only what came after the handover
        # b finished while nobody read it: its record says everything.
        boxes.route([TokenUpdate("b", (10,), FinishReason.STOP)])
        done = boxes.handover_now("b", "r2")
        assert done is not None
        assert done.output_token_ids == (8, 9, 10) and done.finish_reason is FinishReason.STOP
        assert boxes.locate("client-b") is None

    asyncio.run(main())


def _polled_once_then_silent(clock: Clock) -> Outboxes:
    """Router process r1, with request a, polled once and then went quiet for longer
    than a consumer is given."""
    boxes = Outboxes(clock)
    boxes.assign(inp("a", "r1"))
    boxes.poll_ended(boxes.poll_started("r1", 10.0))
    clock.now += LOST_AFTER_S + 1
    return boxes


def test_a_gone_router_processes_requests_are_given_up_after_its_grace() -> None:
    async def main() -> None:
        clock = Clock()
        boxes = _polled_once_then_silent(clock)
        assert boxes.sweep() == (["r1"], [])
        clock.now += 10.0
        assert boxes.sweep() == ([], ["a"])
        assert boxes.consumer_of("a") is None
        assert "r1" not in boxes.consumers

    asyncio.run(main())


def test_a_router_process_that_polls_again_takes_its_outbox_back() -> None:
    async def main() -> None:
        clock = Clock()
        boxes = _polled_once_then_silent(clock)
        boxes.sweep()
        boxes.start_orphans({"a": (4,)})
        boxes.route([TokenUpdate("a", (5,))])
        box = boxes.poll_started("r1", 10.0)
        assert tokens(boxes.take(box)) == {"a": [5]}
        assert boxes.handover_now("a", "r2") is None  # no record left: read the engine

    asyncio.run(main())


def test_a_live_take_over_switches_at_the_step_boundary() -> None:
    async def main() -> None:
        boxes = Outboxes()
        boxes.assign(inp("a", "r1"))
        boxes.route([TokenUpdate("a", (5,)), TokenUpdate("a", (6,))])
        # Read at the boundary after both updates: they are in the handover.
        handover = boxes.handover_at_boundary("a", "r2", (5, 6), kv_pending=False)
        assert handover is not None and handover.output_token_ids == (5, 6)
        boxes.route([TokenUpdate("a", (7,))])
        assert tokens(boxes.take(boxes.poll_started("r1", None))) == {}
        assert tokens(boxes.take(boxes.poll_started("r2", None))) == {"a": [7]}
        # Not on the engine and no reservation: it is not here.
        boxes.assign(inp("c", "r1"))
        assert boxes.handover_at_boundary("c", "r2", None, kv_pending=False) is None
        # Its KV still to land: handed over, its first token to come as an update.
        pending = boxes.handover_at_boundary("c", "r2", None, kv_pending=True)
        assert pending is not None and pending.waiting_for_kv
        boxes.first_token("c", 42)
        assert tokens(boxes.take(boxes.poll_started("r2", None))) == {"c": [42]}

    asyncio.run(main())


def test_a_request_let_go_of_is_kept_for_a_while_then_given_up() -> None:
    async def main() -> None:
        clock = Clock()
        boxes = Outboxes(clock)
        boxes.assign(inp("a", "r1", request_id="client-a"))
        box = boxes.poll_started("r1", 30.0)
        boxes.start_orphans({"a": (4,)}, keep_s=8.0)  # its stream broke; r1 lives on
        boxes.route([TokenUpdate("a", (5,))])
        assert tokens(boxes.take(box)) == {}  # r1 no longer reads it
        clock.now += 5.0
        handover = boxes.handover_now("a", "r2")
        assert handover is not None and handover.output_token_ids == (4, 5)
        boxes.assign(inp("b", "r1"))
        boxes.start_orphans({"b": ()}, keep_s=8.0)
        clock.now += 9.0
        assert boxes.sweep()[1] == ["b"]  # nobody took it over: abort it
        assert boxes.consumer_of("b") is None

    asyncio.run(main())
