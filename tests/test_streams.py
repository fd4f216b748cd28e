"""`--stream-interval`: a stream's chunks merged into messages of at least N tokens, the
first at once and the rest flushed by the final result, nothing lost or reordered."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from engine.core.outputs import FinalResult, TextChunk, Usage
from engine.core.request import FinishReason
from pdserve.v1 import generation_pb2 as pb
from router.grpc_server import GrpcServer
from router.streams import CoalescedStream, check_stream_interval, tokens_per_message
from tests.fake_core import FakeCore, collect, run_with_server

FINAL = FinalResult(FinishReason.LENGTH, Usage(3, 10))


async def _source(items: list[TextChunk | FinalResult]) -> AsyncIterator[TextChunk | FinalResult]:
    for item in items:
        yield item


def _merge(items: list[TextChunk | FinalResult], interval: int) -> list[TextChunk | FinalResult]:
    async def run() -> list[TextChunk | FinalResult]:
        return [out async for out in CoalescedStream(_source(items), interval)]

    return asyncio.run(run())


def _chunks(n: int) -> list[TextChunk | FinalResult]:
    return [TextChunk(f"w{i} ", (i,)) for i in range(n)]


def test_first_chunk_at_once_then_at_least_interval_tokens_then_the_rest_before_final() -> None:
    out = _merge(_chunks(10) + [FINAL], 4)
    assert [o.token_ids for o in out[:-1]] == [(0,), (1, 2, 3, 4), (5, 6, 7, 8), (9,)]
    assert out[-1] is FINAL
    assert "".join(o.text for o in out[:-1]) == "".join(f"w{i} " for i in range(10))


def test_chunks_of_several_tokens_and_empty_ones_keep_every_token_in_order() -> None:
    items: list[TextChunk | FinalResult] = [
        TextChunk("", ()),  # nothing yet: not the first chunk
        TextChunk("ab", (1, 2)),
        TextChunk("", (3,)),  # text held back for a whole UTF-8 character
        TextChunk("cde", (4, 5, 6)),
        TextChunk("f", (7,)),
        FINAL,
    ]
    out = _merge(items, 3)
    assert [o.token_ids for o in out[:-1]] == [(1, 2), (3, 4, 5, 6), (7,)]
    assert [o.text for o in out[:-1]] == ["ab", "cde", "f"]
    assert out[-1] is FINAL


def test_a_final_right_after_the_first_chunk_and_a_stream_without_one() -> None:
    assert _merge([TextChunk("a", (1,)), FINAL], 8) == [TextChunk("a", (1,)), FINAL]
    assert _merge(_chunks(3), 8) == [TextChunk("w0 ", (0,)), TextChunk("w1 w2 ", (1, 2))]
    with pytest.raises(ValueError, match="stream interval"):
        CoalescedStream(_source([]), 0)


def test_the_server_sends_fewer_messages_with_the_same_tokens_and_final() -> None:
    async def body(server: GrpcServer, channel: grpc.aio.Channel, core: FakeCore) -> None:
        responses = await collect(channel, prompt="Hello", max_tokens=16)
        chunks, final = responses[:-1], responses[-1]
        assert [list(r.token_ids) for r in chunks] == [[0], [1, 2, 3], [4, 5, 6]]
        assert "".join(r.text for r in chunks) == "t0 t1 t2 t3 t4 t5 t6 "
        assert final.finish_reason == pb.FINISH_REASON_LENGTH
        assert final.usage.completion_tokens == 7

        assert core.num_aclose == 1  # the core's own stream is closed, as without merging

    run_with_server(FakeCore(num_chunks=7), body, stream_interval=3)


def test_auto_sends_every_token_under_light_load_and_groups_them_as_streams_multiply() -> None:
    assert [tokens_per_message("auto", n) for n in (1, 16, 31)] == [1, 1, 1]
    assert [tokens_per_message("auto", n) for n in (32, 64, 128, 256, 1000)] == [2, 4, 8, 16, 16]
    assert tokens_per_message(4, 1) == tokens_per_message(4, 500) == 4  # a number is fixed


@pytest.mark.parametrize("bad", [0, -1, "fast", 2.5, None])
def test_a_stream_interval_is_auto_or_a_positive_integer(bad: object) -> None:
    with pytest.raises(ValueError, match="stream interval must be 'auto' or an integer >= 1"):
        check_stream_interval(bad)
