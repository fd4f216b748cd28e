"""Live migration on drain, over fake workers: a draining decode worker's running
requests move with their KV to a peer while their streams go on (same tokens, none
missing or repeated, no prompt run again), the drain returns once they have left, and
where the KV cannot move they continue by recompute."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Sequence
from dataclasses import replace
from typing import Any

import grpc
import pytest

from bench.fake_workers import FakePools
from bench.harness.polling import wait_until_async
from engine.core.outputs import FinalResult
from engine.core.request import FinishReason
from pdserve.v1 import admin_pb2 as pb
from router.edge.admin import AdminServicer
from router.fleet.worker_state import WorkerState
from router.observability import metrics
from router.observability.serving_metrics import migrations_counter
from router.serving.orchestrator import DisaggregatedGenerator
from tests.test_migration import _stream, _text, _token
from tests.test_orchestrator import PROMPT, _call, _generator, _run


def _moves(reason: str) -> float:
    migrations_counter()
    value = metrics.get_metrics().registry.get_sample_value(
        "pdserve_request_migrations_total", {"pool": "decode", "reason": reason}
    )
    return value or 0.0


Streamed = tuple[list[int], str, FinalResult]


async def _all_complete_unchanged(tasks: Sequence[Awaitable[Streamed]], num_tokens: int) -> None:
    """Every stream ends at its length with the tokens and text of an undisturbed run."""
    for tokens, text, final in await asyncio.gather(*tasks):
        assert final.finish_reason is FinishReason.LENGTH, final.error
        assert tokens == [_token(k) for k in range(num_tokens)]
        assert text == _text(tokens)


async def _under_way(
    pools: FakePools, n: int, worker: str, max_tokens: int, **sampling: Any
) -> tuple[DisaggregatedGenerator, list[asyncio.Task[Streamed]]]:
    """n streams running on `worker` (the other decode worker opens once they are)."""
    gen = _generator(pools)
    for ref in pools.workers["decode"]:
        if ref.worker_id != worker:
            ref.state = WorkerState.STARTING
    tasks = [
        asyncio.ensure_future(_stream(gen, _call(max_tokens=max_tokens, **sampling)))
        for _ in range(n)
    ]
    while len(pools.fakes[worker].running) < n:
        await asyncio.sleep(0.001)
    for ref in pools.workers["decode"]:
        ref.state = WorkerState.LIVE
    return gen, tasks


def test_a_drain_moves_running_requests_with_their_kv_and_returns_at_once() -> None:
    async def body() -> None:
        pools = FakePools(1, 2, step_s=0.005)
        gen, tasks = await _under_way(pools, 4, "decode-0", max_tokens=200)
        before = _moves("drained_kv")
        await asyncio.wait_for(pools.drain("decode-0"), 1.0)
        assert not any(t.done() for t in tasks)  # the drain did not wait for them
        assert pools.fakes["decode-0"].holds_nothing
        results = await asyncio.gather(*tasks)
        for tokens, text, final in results:
            assert final.finish_reason is FinishReason.LENGTH, final.error
            assert tokens == [_token(k) for k in range(200)]
            assert text == _text(tokens)
            assert final.usage.completion_tokens == 200
        assert _moves("drained_kv") == before + 4
        # Nothing ran again: one prefill per request, the KV went decode to decode.
        assert len(pools.fakes["prefill-0"].calls) == 4
        assert [v for v, _ in pools.fakes["decode-1"].calls].count("submit") == 0
        # One transfer carried all four (the per-message costs paid once), after one
        # pre-copy of their full blocks while they ran; the final one skipped those.
        verbs = [verb for verb, _ in pools.fakes["decode-0"].calls]
        assert verbs.count("precopy") == 1 and verbs.index("precopy") < verbs.index("detach")
        sends = [who for verb, who in pools.fakes["decode-0"].calls if verb == "send_detached"]
        assert len(sends) == 1 and len(sends[0].split(",")) == 4
        # They left the source's schedule in one call and were reserved for in one: no
        # request's pause waits for calls queued behind the others'.
        detaches = [who for verb, who in pools.fakes["decode-0"].calls if verb == "detach"]
        assert len(detaches) == 1 and len(detaches[0].split(",")) == 4
        target_verbs = [verb for verb, _ in pools.fakes["decode-1"].calls]
        assert target_verbs.count("reserve_many") == 1 and "reserve" not in target_verbs
        skipped = pools.fakes["decode-1"].skipped
        assert len(skipped) == 4 and all(n >= 1 for n in skipped.values())
        assert all(f.holds_nothing for f in pools.fakes.values())
        assert all(ref.num_assigned == 0 for ref in pools.all())
        await gen.stop()

    _run(body())


def test_the_log_names_a_moved_request_by_the_clients_request_id(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="router.serving.live_migration")

    async def body() -> None:
        pools = FakePools(1, 2, step_s=0.005)
        gen = _generator(pools)
        pools.workers["decode"][1].state = WorkerState.STARTING
        calls = [replace(_call(max_tokens=200), request_id=f"client-{n}") for n in range(2)]
        tasks = [asyncio.ensure_future(_stream(gen, call)) for call in calls[:1]]
        await wait_until_async(lambda: pools.fakes["decode-0"].running, 5, what="running")
        pools.workers["decode"][1].state = WorkerState.LIVE
        await pools.drain("decode-0")
        tasks.append(asyncio.ensure_future(_stream(gen, calls[1])))
        await wait_until_async(lambda: len(pools.fakes["decode-1"].running) == 2, 5, what="2")
        pools.fakes["decode-1"].no_channel = True  # this drain moves them by recompute
        pools.replace("decode-0")
        await pools.drain("decode-1")
        await _all_complete_unchanged(tasks, 200)
        await gen.stop()

    _run(body())
    lines = [r.getMessage() for r in caplog.records]
    assert any(
        line.startswith("request client-0 moved from decode-0 to decode-1") for line in lines
    )
    for n in range(2):
        assert any(
            line.startswith(f"request client-{n} leaves decode-1 by recompute") for line in lines
        )


def test_a_stop_string_spanning_the_move_still_stops_the_request() -> None:
    async def body() -> None:
        pools = FakePools(1, 2, step_s=0.005)
        # decode-0 holds after output token 5; detached, it also gives token 6, which the
        # router had not received; decode-1 goes on from token 7.
        pools.fakes["decode-0"].hold_after_position = len(PROMPT) + 5
        stop = _text([_token(6)])[-3:] + _text([_token(7)])[:3]
        gen, tasks = await _under_way(pools, 1, "decode-0", max_tokens=200, stop=(stop,))
        held = pools.fakes["decode-0"]
        await wait_until_async(
            lambda: [r.position - 1 for r in held.running.values()] == [held.hold_after_position],
            5,
            what="decode-0 holding after token 5",
        )
        await pools.drain("decode-0")
        tokens, text, final = await tasks[0]
        assert final.finish_reason is FinishReason.STOP, final.error
        assert tokens == [_token(k) for k in range(8)]
        full = _text(tokens)
        assert text == full[: full.index(stop)]
        await gen.stop()

    _run(body())


def test_where_no_channel_can_be_made_requests_move_by_recompute() -> None:
    async def body() -> None:
        pools = FakePools(1, 2, step_s=0.005)
        pools.fakes["decode-0"].no_channel = True
        gen, tasks = await _under_way(pools, 2, "decode-0", max_tokens=60)
        before = _moves("drained")
        await asyncio.wait_for(pools.drain("decode-0"), 1.0)
        await _all_complete_unchanged(tasks, 60)
        assert _moves("drained") == before + 2
        assert all(f.holds_nothing for f in pools.fakes.values())
        await gen.stop()

    _run(body())


def test_no_room_on_the_peer_falls_back_to_recompute_and_frees_the_source() -> None:
    async def body() -> None:
        pools = FakePools(1, 2, step_s=0.005)
        gen, tasks = await _under_way(pools, 2, "decode-0", max_tokens=60)
        pools.fakes["decode-1"].no_room = True
        await asyncio.wait_for(pools.drain("decode-0"), 1.0)
        assert pools.fakes["decode-0"].holds_nothing  # the detached KV was given back
        await _all_complete_unchanged(tasks, 60)
        await gen.stop()

    _run(body())


def _connects(pools: FakePools) -> dict[str, int]:
    return {
        worker_id: [verb for verb, _ in fake.calls].count("connect")
        for worker_id, fake in pools.fakes.items()
        if worker_id.startswith("decode")
    }


def test_eager_peer_channels_are_up_before_a_drain_which_then_makes_none() -> None:
    async def body() -> None:
        lazy_pools = FakePools(1, 2, step_s=0.005)
        lazy = _generator(lazy_pools)
        lazy_pools.announce_live("decode-1")
        await asyncio.sleep(0.05)
        assert _connects(lazy_pools) == {"decode-0": 0, "decode-1": 0}  # made at a drain
        await lazy.stop()

        pools = FakePools(1, 2, step_s=0.005)
        gen = _generator(pools, decode_peer_channels="eager")  # workers live already
        # Both directions: each worker is the sender of one channel, the receiver of one.
        await wait_until_async(lambda: _connects(pools) == {"decode-0": 2, "decode-1": 2}, 5)
        pools.announce_live("decode-1")  # announced again: its channels exist, none is made
        other = pools.workers["decode"][1]
        other.state = WorkerState.STARTING  # the requests all go to decode-0
        tasks = [asyncio.ensure_future(_stream(gen, _call(max_tokens=60))) for _ in range(3)]
        await wait_until_async(lambda: len(pools.fakes["decode-0"].running) == 3, 5)
        other.state = WorkerState.LIVE
        before = _moves("drained_kv")
        await asyncio.wait_for(pools.drain("decode-0"), 1.0)
        assert _connects(pools) == {"decode-0": 2, "decode-1": 2}  # none made by the drain
        assert _moves("drained_kv") == before + 3
        await _all_complete_unchanged(tasks, 60)
        await gen.stop()

    _run(body())


class _Context:
    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise RuntimeError(f"{code.name}: {details}")


def test_migrate_requests_moves_some_with_their_kv_and_the_worker_stays_in_service() -> None:
    async def body() -> None:
        pools = FakePools(1, 2, step_s=0.005)
        gen, tasks = await _under_way(pools, 4, "decode-0", max_tokens=200)
        admin = AdminServicer(lambda: pools, True, lambda: gen)
        before = _moves("rebalanced_kv")
        reply = await admin.MigrateRequests(
            pb.MigrateRequestsRequest(worker_id="decode-0", max_requests=2), _Context()
        )
        assert (reply.num_candidates, reply.moved_with_kv, reply.moved_by_recompute) == (2, 2, 0)
        assert _moves("rebalanced_kv") == before + 2
        source = pools.workers["decode"][0]
        assert source.state is WorkerState.LIVE and len(pools.fakes["decode-0"].running) == 2
        await _all_complete_unchanged(tasks, 200)
        assert all(f.holds_nothing for f in pools.fakes.values())
        await gen.stop()

    _run(body())


def test_migrate_requests_refuses_what_it_cannot_do_with_a_reason() -> None:
    async def body() -> None:
        pools = FakePools(1, 2, step_s=0.005)
        gen = _generator(pools)
        admin = AdminServicer(lambda: pools, True, lambda: gen)

        async def refused(worker_id: str) -> str:
            with pytest.raises(RuntimeError) as info:
                await admin.MigrateRequests(
                    pb.MigrateRequestsRequest(worker_id=worker_id), _Context()
                )
            return str(info.value)

        assert (await refused("decode-7")).startswith("NOT_FOUND")
        assert "decode workers; prefill-0 is a prefill worker" in await refused("prefill-0")
        pools.workers["decode"][1].state = WorkerState.STARTING
        assert await refused("decode-0") == (
            "FAILED_PRECONDITION: no other live decode worker to take its requests"
        )
        await gen.stop()

    _run(body())


def test_a_drain_during_a_rebalance_of_the_same_worker_moves_each_request_once() -> None:
    async def body() -> None:
        pools = FakePools(1, 2, step_s=0.005)
        gen, tasks = await _under_way(pools, 4, "decode-0", max_tokens=120)
        before = {r: _moves(r) for r in ("drained", "drained_kv", "rebalanced", "rebalanced_kv")}
        mover = gen.live_migration
        assert mover is not None
        source = pools.workers["decode"][0]
        result, _ = await asyncio.gather(mover.rebalance(source, None), pools.drain("decode-0"))
        after = {r: _moves(r) - n for r, n in before.items()}
        assert result.with_kv == 4
        assert after == {"drained": 0, "drained_kv": 0, "rebalanced": 0, "rebalanced_kv": 4}
        await _all_complete_unchanged(tasks, 120)
        assert all(f.holds_nothing for f in pools.fakes.values())
        await gen.stop()

    _run(body())
