"""`--stream-interval`: every message after the first waits for N tokens (or the finish),
nothing lost or reordered; `auto` picks N from the number of open streams."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from bench.fake_workers import FakePools, WordTokenizer, token_at
from pdserve.v1 import generation_pb2 as pb
from router.client import stream_generate
from router.config import RouterConfig
from router.grpc_server import GrpcServer
from router.orchestrator import DisaggregatedGenerator
from router.streams import check_stream_interval, tokens_per_message

PROMPT = list(range(100, 164))  # above the short-prompt threshold: prefilled remotely


async def _messages(interval: int | str) -> tuple[list[pb.GenerateResponse], FakePools]:
    """One 10-token request through the gRPC edge over the serving core and fake pools."""
    pools = FakePools(1, 1)
    core = DisaggregatedGenerator(
        pools,  # type: ignore[arg-type]
        WordTokenizer(),
        RouterConfig(retry_delay_s=0.0, stream_interval=interval),  # type: ignore[arg-type]
    )
    core.start()
    server = GrpcServer(core, host="127.0.0.1", port=0, drain_grace_s=2.0)  # type: ignore[arg-type]
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
    assert tokens == [token_at(3, len(PROMPT) + i) for i in range(10)]
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
