"""Drain past the grace period, and a second signal: every stream still gets its final ABORT."""

from __future__ import annotations

import asyncio
import os
import signal

import grpc
import pytest

from bench.harness import wait_until_async
from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import generation_pb2_grpc as pb_grpc
from router.edge.grpc_server import GrpcServer, serve
from tests.fake_core import FakeCore, read_rest, refuses_new_calls, run_with_server


async def _start_calls(channel: grpc.aio.Channel, n: int) -> list[grpc.aio.UnaryStreamCall]:
    """n Generate calls that have each received their first chunk."""
    stub = pb_grpc.GenerationServiceStub(channel)
    calls = [stub.Generate(pb.GenerateRequest(prompt=f"p{i}")) for i in range(n)]
    for call in calls:
        first = await call.read()
        assert first.text
    return calls


async def _assert_one_final_abort(call: grpc.aio.UnaryStreamCall, reason: str) -> None:
    rest = await read_rest(call)  # raises AioRpcError if the call was cut off
    finals = [r for r in rest if r.finish_reason != pb.FINISH_REASON_UNSPECIFIED]
    assert len(finals) == 1 and rest[-1] is finals[0]
    assert finals[0].finish_reason == pb.FINISH_REASON_ABORT
    assert reason in finals[0].error
    assert finals[0].usage.completion_tokens == 1  # the one chunk the client read
    assert await call.code() == grpc.StatusCode.OK


def test_drain_past_grace_gives_every_stream_one_final_abort() -> None:
    async def body(server: GrpcServer, channel: grpc.aio.Channel, core: FakeCore) -> None:
        core.release = asyncio.Event()  # never set: the calls outlive the grace
        calls = await _start_calls(channel, 3)
        await asyncio.wait_for(server.stop(grace=0.2), timeout=5.0)
        for call in calls:
            await _assert_one_final_abort(call, "drain grace of 0.2s is over")
        # Every core stream was closed, so the core released the requests.
        await wait_until_async(lambda: core.num_closed == 3 and core.num_aclose == 3, 2)
        assert core.num_completed == 0

    run_with_server(FakeCore(num_chunks=1), body)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_second_signal_stops_at_once(sig: signal.Signals) -> None:
    """With a 60 s grace, a second SIGTERM/Ctrl-C ends the drain now; the stream gets ABORT."""
    core = FakeCore(num_chunks=1)
    started: list[GrpcServer] = []

    async def main() -> None:
        core.release = asyncio.Event()  # never set
        task = asyncio.create_task(
            serve(core, "127.0.0.1", 0, drain_grace_s=60.0, on_started=started.append)
        )
        await wait_until_async(lambda: started, 5)
        async with grpc.aio.insecure_channel(started[0].address) as channel:
            (call,) = await _start_calls(channel, 1)
            os.kill(os.getpid(), sig)
            # The first signal drains: new calls are refused, the one in flight is awaited.
            await wait_until_async(lambda: refuses_new_calls(channel), 5)
            assert not task.done()
            os.kill(os.getpid(), sig)
            await asyncio.wait_for(task, timeout=5.0)
            await _assert_one_final_abort(call, "second signal")

    asyncio.run(main())


def test_a_signal_after_the_server_stopped_counts_as_the_stop_asked_for() -> None:
    """A service stopped by its Ray going down, whose own SIGTERM arrives a moment later
    (a stop that signals every process), was stopped on purpose: it exits 0."""
    started: list[GrpcServer] = []

    async def main() -> None:
        task = asyncio.create_task(serve(FakeCore(), "127.0.0.1", 0, on_started=started.append))
        await wait_until_async(lambda: started, 5)
        server = started[0]
        server.stop_now("the workers went down")
        await asyncio.wait_for(task, timeout=5.0)
        assert not await server.wait_for_signal(0.05)  # nobody signalled: Ray was lost
        os.kill(os.getpid(), signal.SIGTERM)
        assert await server.wait_for_signal(2.0)
        assert server.stopped_by_signal

    asyncio.run(main())
