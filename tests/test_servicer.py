"""GenerationService over a real grpc.aio server on loopback, with a scripted core."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from bench.harness import wait_until_async
from engine.core.outputs import FinalResult, TextChunk, Usage
from engine.core.request import FinishReason
from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import generation_pb2_grpc as pb_grpc
from router.cli.client import get_pool_stats, stream_generate
from router.edge.grpc_server import GENERATION_SERVICE, GrpcServer, serve
from router.edge.servicer import CORE_FINAL_WAIT_S
from router.fleet import port_holds
from router.serving.errors import NotReadyError, QueueFullError
from router.serving.protocol import GenerateCall
from tests.fake_core import (
    MAX_MODEL_LEN,
    FakeCore,
    collect,
    expect_code,
    health_is,
    health_status,
    read_rest,
    refuses_new_calls,
    run_with_server,
)


def test_streams_chunks_then_one_final() -> None:
    async def body(server: GrpcServer, channel: grpc.aio.Channel, core: FakeCore) -> None:
        responses = await collect(channel, prompt="Hello", max_tokens=3, temperature=0.7)
        assert [r.text for r in responses[:-1]] == ["t0 ", "t1 ", "t2 "]
        assert [list(r.token_ids) for r in responses[:-1]] == [[0], [1], [2]]
        final = responses[-1]
        assert final.finish_reason == pb.FINISH_REASON_LENGTH
        assert final.usage.completion_tokens == 3
        assert final.timings.time_to_first_token_seconds == pytest.approx(0.01)
        assert all(r.finish_reason == pb.FINISH_REASON_UNSPECIFIED for r in responses[:-1])
        call = core.calls[0]
        assert call.prompt == "Hello" and call.prompt_token_ids is None
        # float32 on the wire, but the core sees what the user wrote.
        assert call.sampling.temperature == 0.7
        assert call.sampling.max_tokens == 3 and call.sampling.top_p == 1.0

    run_with_server(FakeCore(), body)


def test_unset_sampling_takes_engine_defaults_and_inputs_convert() -> None:
    async def body(server: GrpcServer, channel: grpc.aio.Channel, core: FakeCore) -> None:
        await collect(channel, prompt_token_ids=[5, 6, 7], priority=3)
        await collect(channel, messages=[("system", "be brief"), ("user", "hi")])
        tokens_call, chat_call = core.calls
        assert tokens_call.prompt_token_ids == (5, 6, 7) and tokens_call.priority == 3
        assert tokens_call.sampling.max_tokens == 16 and tokens_call.sampling.temperature == 1.0
        assert tokens_call.sampling.seed is None
        assert chat_call.messages is not None
        assert [(m.role, m.content) for m in chat_call.messages] == [
            ("system", "be brief"),
            ("user", "hi"),
        ]

    run_with_server(FakeCore(), body)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "temperature": -1.0}, "temperature"),
        ({"prompt": "hi", "temperature": float("nan")}, "temperature"),
        ({"prompt": "hi", "top_p": 0.0}, "top_p"),
        ({"prompt": "hi", "top_p": 1.5}, "top_p"),
        ({"prompt": "hi", "top_k": -1}, "top_k"),
        ({"prompt": "hi", "seed": 2**63}, "seed"),
        ({"prompt": "hi", "stop": [""]}, "stop"),
        ({"prompt": ""}, "prompt"),
        ({"prompt_token_ids": []}, "prompt_token_ids"),
        ({"prompt_token_ids": [1] * MAX_MODEL_LEN}, "max_model_len"),
        ({"messages": []}, "messages"),
        ({"messages": [("", "hi")]}, "role"),
        ({}, "prompt, prompt_token_ids or messages"),
        ({"prompt": "hi", "request_id": "has space"}, "request_id"),
    ],
)
def test_invalid_request_names_field_and_server_keeps_serving(
    kwargs: dict[str, Any], field: str
) -> None:
    async def body(server: GrpcServer, channel: grpc.aio.Channel, core: FakeCore) -> None:
        details = await expect_code(grpc.StatusCode.INVALID_ARGUMENT, channel, **kwargs)
        assert field in details
        assert core.calls == []  # rejected at the edge, the core never saw it
        responses = await collect(channel, prompt="ok")
        assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH

    run_with_server(FakeCore(), body)


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (QueueFullError("queue full: 32 waiting"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (NotReadyError("decode pool restarting"), grpc.StatusCode.UNAVAILABLE),
        (ValueError("prompt: 70 tokens exceed max_model_len 64"), grpc.StatusCode.INVALID_ARGUMENT),
        (RuntimeError("boom"), grpc.StatusCode.INTERNAL),
    ],
)
def test_core_errors_map_to_status(exc: Exception, code: grpc.StatusCode) -> None:
    async def body(server: GrpcServer, channel: grpc.aio.Channel, core: FakeCore) -> None:
        details = await expect_code(code, channel, prompt="hi")
        assert str(exc) in details
        assert core.num_closed == 1 and core.num_aclose == 1

    run_with_server(FakeCore(raise_exc=exc), body)


def test_core_refusing_before_streaming_maps_to_status() -> None:
    async def body(server: GrpcServer, channel: grpc.aio.Channel, core: FakeCore) -> None:
        core.raise_sync = QueueFullError("queue full")
        await expect_code(grpc.StatusCode.RESOURCE_EXHAUSTED, channel, prompt="hi")
        core.raise_sync = None
        assert (await collect(channel, prompt="ok"))[-1].finish_reason == pb.FINISH_REASON_LENGTH

    run_with_server(FakeCore(), body)


def test_not_ready_core_is_unavailable() -> None:
    async def body(server: GrpcServer, channel: grpc.aio.Channel, core: FakeCore) -> None:
        core.ready = False
        await expect_code(grpc.StatusCode.UNAVAILABLE, channel, prompt="hi")
        assert core.calls == []

    run_with_server(FakeCore(), body)


def test_error_finish_sends_final_then_internal() -> None:
    async def body(server: GrpcServer, channel: grpc.aio.Channel, core: FakeCore) -> None:
        received: list[pb.GenerateResponse] = []
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for r in stream_generate(channel, prompt="hi"):
                received.append(r)
        assert info.value.code() == grpc.StatusCode.INTERNAL
        assert "KV transfer failed" in (info.value.details() or "")
        assert received[-1].finish_reason == pb.FINISH_REASON_ERROR
        assert received[-1].error == "KV transfer failed"
        assert received[-1].usage.completion_tokens == 2

    run_with_server(
        FakeCore(num_chunks=2, finish=FinishReason.ERROR, error="KV transfer failed"), body
    )


def test_deadline_closes_core_stream() -> None:
    async def body(server: GrpcServer, channel: grpc.aio.Channel, core: FakeCore) -> None:
        await expect_code(grpc.StatusCode.DEADLINE_EXCEEDED, channel, prompt="hi", timeout=0.3)
        await asyncio.wait_for(core.closed.wait(), timeout=2.0)
        await wait_until_async(lambda: core.num_aclose == 1, 2.0)
        assert core.num_completed == 0
        await wait_until_async(lambda: server.num_in_flight == 0, 2.0)

    run_with_server(FakeCore(num_chunks=100, delay_s=0.05), body)


def test_client_cancel_closes_core_stream() -> None:
    async def body(server: GrpcServer, channel: grpc.aio.Channel, core: FakeCore) -> None:
        call = pb_grpc.GenerationServiceStub(channel).Generate(pb.GenerateRequest(prompt="hi"))
        assert (await call.read()).text == "t0 "
        assert (await call.read()).text == "t1 "
        call.cancel()
        await asyncio.wait_for(core.closed.wait(), timeout=2.0)
        assert core.num_completed == 0
        await wait_until_async(lambda: server.num_in_flight == 0 and core.num_aclose == 1, 2.0)

    run_with_server(FakeCore(num_chunks=1000, delay_s=0.01), body)


def test_health_follows_warmup_and_drain() -> None:
    serving = health_pb2.HealthCheckResponse.SERVING
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING

    async def body(server: GrpcServer, channel: grpc.aio.Channel, core: FakeCore) -> None:
        for service in ("", GENERATION_SERVICE):
            assert await health_status(channel, service) == not_serving
        await server.set_serving()
        for service in ("", GENERATION_SERVICE):
            assert await health_status(channel, service) == serving

        # A call in flight when the drain starts finishes normally.
        core.release = asyncio.Event()
        call = pb_grpc.GenerationServiceStub(channel).Generate(pb.GenerateRequest(prompt="hi"))
        assert (await call.read()).text == "t0 "
        server.drain_notice_s = 0.3
        stop = asyncio.create_task(server.stop(grace=5.0))
        # Health turns NOT_SERVING first; once the notice is over, new calls are refused.
        await wait_until_async(lambda: health_is(channel, GENERATION_SERVICE, not_serving), 2)
        await wait_until_async(lambda: refuses_new_calls(channel), 5)
        await server.set_serving()  # the owner cannot flip a drain back
        assert await health_status(channel, GENERATION_SERVICE) == not_serving
        assert not stop.done()  # the drain is refusing calls, and waits for the one in flight
        core.release.set()
        rest = await read_rest(call)
        assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
        await asyncio.wait_for(stop, timeout=2.0)
        assert core.num_completed == 1

    run_with_server(FakeCore(), body, serving=False)


def test_health_list_answers_every_service_as_check_does() -> None:
    serving = health_pb2.HealthCheckResponse.SERVING
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING

    async def statuses(channel: grpc.aio.Channel) -> dict[str, int]:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.List(health_pb2.HealthListRequest(), timeout=5)
        return {service: response.status for service, response in reply.statuses.items()}

    async def body(server: GrpcServer, channel: grpc.aio.Channel, core: FakeCore) -> None:
        assert await statuses(channel) == {"": not_serving, GENERATION_SERVICE: not_serving}
        await server.set_serving()
        assert await statuses(channel) == {"": serving, GENERATION_SERVICE: serving}
        server.drain_notice_s = 1.0  # the port answers while the drain gives notice
        stop = asyncio.create_task(server.stop(grace=0))
        draining = {"": not_serving, GENERATION_SERVICE: not_serving}

        async def drained() -> bool:
            return await statuses(channel) == draining

        await wait_until_async(drained, 2.0, what="List answers NOT_SERVING for every service")
        await stop

    run_with_server(FakeCore(), body, serving=False)


def test_drain_grace_ends_stragglers_with_abort() -> None:
    async def body(server: GrpcServer, channel: grpc.aio.Channel, core: FakeCore) -> None:
        core.release = asyncio.Event()  # never set: the call outlives the grace
        call = pb_grpc.GenerationServiceStub(channel).Generate(pb.GenerateRequest(prompt="hi"))
        await call.read()
        await asyncio.wait_for(server.stop(grace=0.2), timeout=3.0)
        await asyncio.wait_for(core.closed.wait(), timeout=2.0)
        await wait_until_async(lambda: core.num_aclose == 1, 2.0)
        assert core.num_completed == 0
        rest = await read_rest(call)
        assert rest[-1].finish_reason == pb.FINISH_REASON_ABORT

    run_with_server(FakeCore(), body)


def test_reflection_lists_services() -> None:
    async def body(server: GrpcServer, channel: grpc.aio.Channel, core: FakeCore) -> None:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        responses = [r async for r in stub.ServerReflectionInfo(iter([request]), timeout=5)]
        names = {s.name for s in responses[0].list_services_response.service}
        assert "pdserve.v1.GenerationService" in names
        assert "grpc.health.v1.Health" in names

    run_with_server(FakeCore(), body)


def test_request_id_from_header_body_or_assigned() -> None:
    async def body(server: GrpcServer, channel: grpc.aio.Channel, core: FakeCore) -> None:
        stub = pb_grpc.GenerationServiceStub(channel)

        call = stub.Generate(pb.GenerateRequest(prompt="a"), metadata=(("x-request-id", "hdr-1"),))
        responses = [r async for r in call]
        assert dict(await call.initial_metadata())["x-request-id"] == "hdr-1"
        assert {r.request_id for r in responses} == {"hdr-1"}

        call = stub.Generate(
            pb.GenerateRequest(prompt="b", request_id="body-1"),
            metadata=(("x-request-id", "hdr-2"),),
        )
        responses = [r async for r in call]
        assert dict(await call.initial_metadata())["x-request-id"] == "body-1"
        assert {r.request_id for r in responses} == {"body-1"}

        call = stub.Generate(pb.GenerateRequest(prompt="c"))
        responses = [r async for r in call]
        assigned = dict(await call.initial_metadata())["x-request-id"]
        assert len(assigned) == 32 and {r.request_id for r in responses} == {assigned}

        assert [c.request_id for c in core.calls] == ["hdr-1", "body-1", assigned]

        bad_header = (("x-request-id", "x" * 200),)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(channel, prompt="d", metadata=bad_header)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "x-request-id" in (info.value.details() or "")

    run_with_server(FakeCore(), body)


def test_request_id_header_comes_with_a_refusal_or_a_cancel_at_once() -> None:
    """The response headers leave while the handler starts: a call refused before they
    are out still gets them, then its status; one cancelled as it reaches the core leaves
    the server serving and the core's stream closed."""

    async def body(server: GrpcServer, channel: grpc.aio.Channel, core: FakeCore) -> None:
        stub = pb_grpc.GenerationServiceStub(channel)
        core.raise_sync = QueueFullError("queue full")
        call = stub.Generate(pb.GenerateRequest(prompt="a"), metadata=(("x-request-id", "r-1"),))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            _ = [r async for r in call]
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert dict(await call.initial_metadata())["x-request-id"] == "r-1"
        core.raise_sync = None

        core.delay_s = 0.5
        call = stub.Generate(pb.GenerateRequest(prompt="b"))
        while len(core.calls) < 2:
            await asyncio.sleep(0.001)
        call.cancel()
        await asyncio.wait_for(core.closed.wait(), timeout=5)
        core.delay_s = 0.0
        responses = await collect(channel, prompt="c")
        assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert core.num_aclose == 2  # b and c: a was refused before it had a stream

    run_with_server(FakeCore(), body)


def test_server_info_and_pool_stats() -> None:
    async def body(server: GrpcServer, channel: grpc.aio.Channel, core: FakeCore) -> None:
        stub = pb_grpc.GenerationServiceStub(channel)
        info = await stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=5)
        assert (info.model, info.max_model_len, info.block_size) == ("fake-model", 64, 16)
        assert (info.num_prefill_workers, info.num_decode_workers) == (1, 2)
        assert info.num_colocated_workers == 3
        assert (info.max_in_flight, info.max_queue) == (8, 32)
        stats = await get_pool_stats(server.address)
        (worker,) = stats.workers
        assert worker.pool == pb.POOL_DECODE and worker.index == 1
        assert (worker.num_blocks_total, worker.num_blocks_in_use) == (100, 7)
        assert (worker.prefix_hit_tokens, worker.prefix_query_tokens) == (32, 64)
        assert (stats.num_in_flight, stats.num_queued) == (1, 0)

    run_with_server(FakeCore(), body)


def test_port_in_use_fails_loudly() -> None:
    async def main() -> None:
        first = GrpcServer(FakeCore(), port=0)
        port = await first.start()
        try:
            with pytest.raises(OSError, match=str(port)):
                await GrpcServer(FakeCore(), port=port).start()
        finally:
            await first.stop(0)

    asyncio.run(main())


def test_a_port_held_before_ray_starts_goes_to_the_routers_server_alone() -> None:
    """The service binds its port before Ray's processes start: a gRPC server of another
    (as Ray's are) cannot take it meanwhile, and the router's own server binds it."""

    async def main() -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        assert port_holds.hold("127.0.0.1", port) is None
        try:
            foreign = grpc.aio.server()
            try:
                bound = foreign.add_insecure_port(f"127.0.0.1:{port}")
            except RuntimeError:
                bound = 0
            assert bound == 0
            ours = GrpcServer(FakeCore(), host="127.0.0.1", port=port)
            assert await ours.start() == port
            await ours.stop(0)
        finally:
            port_holds.release_all()
        assert port_holds.hold("127.0.0.1", port) is None  # let go of: free again
        port_holds.release_all()

    asyncio.run(main())


def test_serve_warms_up_then_drains_on_sigterm() -> None:
    """serve(): NOT_SERVING during warm-up, SERVING after, SIGTERM drains and returns."""
    core = FakeCore()
    started: list[GrpcServer] = []

    async def main() -> None:
        warm = asyncio.Event()
        core.release = asyncio.Event()

        async def warm_up() -> None:
            await warm.wait()

        task = asyncio.create_task(
            serve(
                core,
                "127.0.0.1",
                0,
                drain_grace_s=5.0,
                warm_up=warm_up(),
                on_started=started.append,
            )
        )
        await wait_until_async(lambda: started, 5)
        async with grpc.aio.insecure_channel(started[0].address) as channel:
            assert await health_status(channel, "") == health_pb2.HealthCheckResponse.NOT_SERVING
            warm.set()  # serve() flips to SERVING once warm-up returns
            await wait_until_async(
                lambda: health_is(channel, "", health_pb2.HealthCheckResponse.SERVING), 2
            )
            call = pb_grpc.GenerationServiceStub(channel).Generate(pb.GenerateRequest(prompt="x"))
            await call.read()
            os.kill(os.getpid(), signal.SIGTERM)
            await wait_until_async(lambda: refuses_new_calls(channel), 5)
            assert not task.done()  # draining: waits for the call in flight
            core.release.set()
            rest = await read_rest(call)
            assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
        await asyncio.wait_for(task, timeout=3.0)

    asyncio.run(main())
    assert core.num_completed == 1


def test_a_core_stuck_on_an_abort_still_gives_the_call_its_final_abort() -> None:
    """A drain past its grace while the core, told of the abort, hangs on its way out (a
    call to a worker that went down with the service): the edge sends the call's final
    ABORT itself, well before the server stops and cuts the connection."""

    class StuckOnAbort(FakeCore):
        def generate(self, call: GenerateCall) -> AsyncIterator[TextChunk | FinalResult]:
            self.calls.append(call)
            return self._stuck()

        async def _stuck(self) -> AsyncGenerator[TextChunk | FinalResult, None]:
            yield TextChunk(text="t0 ", token_ids=(0,))
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                await asyncio.sleep(60)  # the abort's clean-up never ends
            yield FinalResult(FinishReason.LENGTH, Usage(2, 1))

    async def body(server: GrpcServer, channel: grpc.aio.Channel, core: FakeCore) -> None:
        call = pb_grpc.GenerationServiceStub(channel).Generate(pb.GenerateRequest(prompt="hi"))
        await call.read()
        loop = asyncio.get_running_loop()
        stopping = asyncio.ensure_future(server.stop(grace=0.1))
        started = loop.time()
        final = await call.read()
        assert final.finish_reason == pb.FINISH_REASON_ABORT, final
        assert "drain grace" in final.error and final.usage.completion_tokens == 1
        assert loop.time() - started < 0.1 + 2 * CORE_FINAL_WAIT_S
        # The core never lets go of the call: the server's stop cuts it after its flush,
        # with nothing more sent to the client.
        with pytest.raises(grpc.aio.AioRpcError):
            await call.read()
        await stopping

    run_with_server(StuckOnAbort(), body)


def test_an_abort_that_cuts_a_chunks_write_off_still_sends_one_final() -> None:
    """The stop comes while a chunk's write waits for the client to read (flow control):
    gRPC takes one write a call at a time, so the final ABORT goes out once that write
    has, and the client reads every chunk, then that final."""
    chunk_text = "x" * (256 * 1024)

    class Flood(FakeCore):
        def generate(self, call: GenerateCall) -> AsyncIterator[TextChunk | FinalResult]:
            self.calls.append(call)
            return self._flood()

        async def _flood(self) -> AsyncGenerator[TextChunk | FinalResult, None]:
            for i in range(10_000):
                yield TextChunk(text=chunk_text, token_ids=(i,))

    async def body(server: GrpcServer, channel: grpc.aio.Channel, core: FakeCore) -> None:
        call = pb_grpc.GenerationServiceStub(channel).Generate(pb.GenerateRequest(prompt="hi"))
        await call.read()
        await asyncio.sleep(0.3)  # the server's writes stall: the client is not reading
        server.stop_now("the workers went down")
        rest = await asyncio.wait_for(read_rest(call), 5)
        finals = [r for r in rest if r.finish_reason != pb.FINISH_REASON_UNSPECIFIED]
        assert len(finals) == 1 and rest[-1] is finals[0], [r.finish_reason for r in rest]
        assert finals[0].finish_reason == pb.FINISH_REASON_ABORT
        assert "went down" in finals[0].error
        assert await call.code() == grpc.StatusCode.OK

    run_with_server(Flood(), body)
