"""`--stream-interval`: every message after the first waits for N tokens (or the finish),
nothing lost or reordered; `auto` picks N from the number of open streams. And the end of
a stream the server cuts short: its final ABORT message, written by the core."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from bench.fake_workers import FakePools, tokens_after
from bench.harness import wait_until_async
from engine.core.outputs import TextChunk, Usage
from engine.core.request import FinishReason
from engine.sampling_params import SamplingParams
from pdserve.v1 import generation_pb2 as pb
from router.cli.client import stream_generate
from router.edge.grpc_server import GrpcServer
from router.edge.servicer import _final_from_core
from router.edge.streams import (
    StreamInterval,
    check_stream_interval,
    close_stream,
    tokens_per_message,
)
from router.serving.config import RouterConfig
from router.serving.orchestrator import DisaggregatedGenerator
from router.serving.protocol import GenerateCall, ServerAbort
from tests.fakes import WordTokenizer

PROMPT = list(range(100, 164))  # above the short-prompt threshold: prefilled remotely


async def _messages(interval: StreamInterval) -> tuple[list[pb.GenerateResponse], FakePools]:
    """One 10-token request through the gRPC edge over the serving core and fake pools."""
    pools = FakePools(1, 1)
    core = DisaggregatedGenerator(
        pools,
        WordTokenizer(),
        RouterConfig(retry_delay_s=0.0, stream_interval=interval),
    )
    core.start()
    server = GrpcServer(core, host="127.0.0.1", port=0, drain_grace_s=2.0)
    await server.start()
    await server.set_serving()
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            responses = [
                r
                async for r in stream_generate(
                    channel, prompt_token_ids=PROMPT, max_tokens=10, seed=3, ignore_eos=True
                )
            ]
    finally:
        await server.stop(0)
        await core.stop()
    return responses, pools


@pytest.mark.parametrize("interval", [1, 3, 4])
def test_each_message_after_the_first_waits_for_the_interval_and_the_finish_flushes(
    interval: int,
) -> None:
    responses, pools = asyncio.run(_messages(interval))
    chunks, final = responses[:-1], responses[-1]
    sizes = [len(r.token_ids) for r in chunks]
    assert sizes[0] == 1, sizes  # the first token at once
    assert all(size >= interval for size in sizes[1:-1]), sizes
    assert len(sizes) <= 1 + -(-9 // interval), sizes  # never more messages than that
    tokens = [t for r in chunks for t in r.token_ids]
    assert tokens == tokens_after(PROMPT, 3, 10)
    assert "".join(r.text for r in chunks) == "".join(f"<{t}>" for t in tokens)
    assert final.finish_reason == pb.FINISH_REASON_LENGTH
    assert final.usage.completion_tokens == 10
    assert all(fake.holds_nothing for fake in pools.fakes.values())


def test_auto_sends_every_token_under_light_load_and_groups_them_as_streams_multiply() -> None:
    assert [tokens_per_message("auto", n) for n in (1, 16, 31)] == [1, 1, 1]
    assert [tokens_per_message("auto", n) for n in (32, 64, 128, 256, 1000)] == [2, 4, 8, 16, 16]
    assert tokens_per_message(4, 1) == tokens_per_message(4, 500) == 4  # a number is fixed


@pytest.mark.parametrize("bad", [0, -1, "fast", 2.5, None])
def test_a_stream_interval_is_auto_or_a_positive_integer(bad: object) -> None:
    with pytest.raises(ValueError, match="stream interval must be 'auto' or an integer >= 1"):
        check_stream_interval(bad)


def test_a_stream_the_drain_ends_gets_its_usage_and_timings_in_the_final_abort() -> None:
    """Past the drain's grace the core writes the ABORT: the prompt's token count, the
    tokens sent, and the phase timings it measured, not zeros."""

    async def main() -> tuple[list[pb.GenerateResponse], FakePools]:
        pools = FakePools(1, 1)
        pools.fakes["decode-0"].hold_after_position = len(PROMPT) + 4  # then stalls
        core = DisaggregatedGenerator(
            pools,
            WordTokenizer(),
            RouterConfig(retry_delay_s=0.0),
        )
        core.start()
        server = GrpcServer(core, host="127.0.0.1", port=0)
        await server.start()
        await server.set_serving()
        responses: list[pb.GenerateResponse] = []
        try:
            async with grpc.aio.insecure_channel(server.address) as channel:
                call = stream_generate(
                    channel, prompt_token_ids=PROMPT, max_tokens=50, seed=3, ignore_eos=True
                )
                async for response in call:
                    responses.append(response)
                    if sum(len(r.token_ids) for r in responses) == 5:
                        break
                stopping = asyncio.ensure_future(server.stop(grace=0.1))
                responses += [r async for r in call]
                await stopping
            await wait_until_async(
                lambda: all(fake.holds_nothing for fake in pools.fakes.values()),
                2.0,
                what="the aborts reached the workers",
            )
        finally:
            await server.stop(0)
            await core.stop()
        return responses, pools

    responses, pools = asyncio.run(asyncio.wait_for(main(), 10))
    final = responses[-1]
    assert final.finish_reason == pb.FINISH_REASON_ABORT
    assert "shutting down" in final.error
    assert final.usage.prompt_tokens == len(PROMPT)
    assert final.usage.completion_tokens == 5
    assert final.timings.time_to_first_token_seconds > 0
    assert final.timings.decode_seconds >= 0.1  # the stall until the grace ran out


def test_a_server_abort_between_two_messages_gets_the_cores_final_message() -> None:
    """The drain's cancel may reach the call while it writes, not while the core waits:
    the core, suspended between two items, still answers with its own final ABORT."""

    async def main() -> None:
        pools = FakePools(1, 1)
        core = DisaggregatedGenerator(
            pools,
            WordTokenizer(),
            RouterConfig(retry_delay_s=0.0),
        )
        core.start()
        call = GenerateCall("r1", None, tuple(PROMPT), None, SamplingParams(max_tokens=50, seed=3))
        stream = core.generate(call)
        first = await anext(stream)
        assert isinstance(first, TextChunk)
        final = await _final_from_core(stream, ServerAbort("server shutting down: test"))
        assert final is not None and final.finish_reason is FinishReason.ABORT
        assert final.error == "server shutting down: test"
        assert final.usage == Usage(len(PROMPT), 1)
        assert final.timings.time_to_first_token_s > 0
        await close_stream(stream, "r1")
        await wait_until_async(
            lambda: all(fake.holds_nothing for fake in pools.fakes.values()),
            2.0,
            what="the aborts reached the workers",
        )
        await core.stop()

    asyncio.run(asyncio.wait_for(main(), 10))
