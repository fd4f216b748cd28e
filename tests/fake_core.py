"""A scripted core behind a real grpc.aio server on loopback: the router's edge (servicer,
drain, security, metrics, bench.load) tested without workers, in milliseconds."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.core.outputs import FinalResult, PhaseTimings, TextChunk, Usage
from engine.core.request import FinishReason
from engine.wire import PoolName, WorkerStats
from pdserve.v1 import generation_pb2 as pb
from router.cli.client import stream_generate
from router.edge.grpc_server import GrpcServer
from router.serving.protocol import GenerateCall, PoolStats, ServerInfo

MAX_MODEL_LEN = 64


class FakeCore:
    """Scripted Generator: `num_chunks` chunks `delay_s` apart, then a final result.

    `script`, when given, says how each call in turn ends (then `finish` for the rest): a
    finish reason for its final message, or an exception its stream raises at once."""

    def __init__(
        self,
        *,
        num_chunks: int = 3,
        delay_s: float = 0.0,
        raise_exc: Exception | None = None,
        finish: FinishReason = FinishReason.LENGTH,
        script: list[FinishReason | Exception] | None = None,
        error: str = "",
        cached_prompt_tokens: int = 0,
    ) -> None:
        self.num_chunks = num_chunks
        self.delay_s = delay_s
        self.raise_exc = raise_exc
        self.finish = finish
        self.script = list(script or [])
        self.error = error
        self.cached_prompt_tokens = cached_prompt_tokens
        self.ready = True
        self.raise_sync: Exception | None = None  # raised by generate() itself
        self.calls: list[GenerateCall] = []
        self.num_closed = 0  # the stream's `finally` ran
        self.num_aclose = 0  # the servicer called aclose(), as the core's contract asks
        self.num_completed = 0
        self.closed = asyncio.Event()
        self.release: asyncio.Event | None = None  # when set, hold the final until released

    def generate(self, call: GenerateCall) -> AsyncIterator[TextChunk | FinalResult]:
        """Record the call and return its scripted stream."""
        self.calls.append(call)
        if self.raise_sync is not None:
            raise self.raise_sync
        end = self.script.pop(0) if self.script else self.finish
        return ClosableStream(self, self._stream(call, end))

    async def _stream(
        self, call: GenerateCall, end: FinishReason | Exception
    ) -> AsyncGenerator[TextChunk | FinalResult, None]:
        try:
            if isinstance(end, Exception):
                raise end
            if self.raise_exc is not None:
                raise self.raise_exc
            for i in range(self.num_chunks):
                await asyncio.sleep(self.delay_s)
                yield TextChunk(text=f"t{i} ", token_ids=(i,))
            if self.release is not None:
                await self.release.wait()
            # Counted before the yield: the servicer closes the stream right after the final.
            self.num_completed += 1
            prompt_tokens = len(call.prompt_token_ids) if call.prompt_token_ids else 2
            yield FinalResult(
                finish_reason=end,
                usage=Usage(
                    prompt_tokens=prompt_tokens,
                    completion_tokens=self.num_chunks,
                    cached_prompt_tokens=min(self.cached_prompt_tokens, prompt_tokens),
                ),
                timings=PhaseTimings(time_to_first_token_s=0.01),
                error=self.error,
            )
        finally:
            self.num_closed += 1
            self.closed.set()

    def server_info(self) -> ServerInfo:
        return ServerInfo("fake-model", MAX_MODEL_LEN, 16, 1, 2, 8, 32, num_colocated_workers=3)

    async def pool_stats(self) -> PoolStats:
        worker = WorkerStats(PoolName.DECODE, 1, 100, 7, 1, 0, 32, 64)
        return PoolStats(workers=(worker,), num_in_flight=1, num_queued=0)

    def is_ready(self) -> bool:
        return self.ready


class ClosableStream:
    """Counts explicit aclose() calls; a bare async generator would also be closed by GC,
    which would hide a servicer that forgets to close (a real core's stream might not be)."""

    def __init__(self, core: FakeCore, inner: AsyncGenerator[TextChunk | FinalResult, None]):
        self._core = core
        self._inner = inner

    def __aiter__(self) -> ClosableStream:
        return self

    async def __anext__(self) -> TextChunk | FinalResult:
        return await self._inner.__anext__()

    async def aclose(self) -> None:
        self._core.num_aclose += 1
        await self._inner.aclose()


Body = Callable[[GrpcServer, grpc.aio.Channel, FakeCore], Coroutine[Any, Any, None]]


def run_with_server(core: FakeCore, body: Body, *, serving: bool = True) -> None:
    """Start a server on 127.0.0.1:0 around `body`, then stop it (one event loop per test)."""

    async def main() -> None:
        server = GrpcServer(core, host="127.0.0.1", port=0, drain_grace_s=2.0)
        await server.start()
        if serving:
            await server.set_serving()
        try:
            async with grpc.aio.insecure_channel(server.address) as channel:
                await body(server, channel, core)
        finally:
            await server.stop(0)

    asyncio.run(main())


async def collect(channel: grpc.aio.Channel, **kwargs: Any) -> list[pb.GenerateResponse]:
    """Every message of one Generate call (raises AioRpcError if the call fails)."""
    return [r async for r in stream_generate(channel, **kwargs)]


async def expect_code(code: grpc.StatusCode, channel: grpc.aio.Channel, **kwargs: Any) -> str:
    """Run a Generate call that must fail with `code`; return its details."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(channel, **kwargs)
    assert info.value.code() == code, info.value.details()
    return info.value.details() or ""


async def read_rest(call: Any) -> list[pb.GenerateResponse]:
    """Read a call to its end with read() (grpc.aio forbids mixing read() and iteration)."""
    responses = []
    while (response := await call.read()) is not grpc.aio.EOF:
        responses.append(response)
    return responses


async def health_status(channel: grpc.aio.Channel, service: str) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    response = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return response.status


async def health_is(channel: grpc.aio.Channel, service: str, status: int) -> bool:
    return await health_status(channel, service) == status


async def refuses_new_calls(channel: grpc.aio.Channel) -> bool:
    """Whether a new Generate call is refused as UNAVAILABLE (a draining server). A call
    still accepted ends at its short deadline, so a probe never stays in flight."""
    try:
        await collect(channel, prompt="probe", timeout=0.5)
    except grpc.aio.AioRpcError as exc:
        return exc.code() == grpc.StatusCode.UNAVAILABLE
    return False
