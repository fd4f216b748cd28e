"""Resumed streams when the request is nowhere: NOT_FOUND once the client has tokens
(the request ended, or its router process went away past the grace), a new run when
it has none (the first call broke before any token)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import grpc
import pytest

from bench.fake_workers import FakePools, tokens_after
from engine.core.outputs import FinalResult, TextChunk
from engine.sampling_params import SamplingParams
from router.edge.servicer import _failure_status
from router.serving.config import RouterConfig
from router.serving.errors import ResumeNotFoundError
from router.serving.orchestrator import DisaggregatedGenerator
from router.serving.protocol import GenerateCall
from router.serving.run import resume
from tests.fakes import WordTokenizer

PROMPT = tuple(range(100, 164))


def _call(resume_from_tokens: int | None) -> GenerateCall:
    params = SamplingParams(max_tokens=6, seed=3, ignore_eos=True)
    return GenerateCall(
        "client-1", None, PROMPT, None, params, resume_from_tokens=resume_from_tokens
    )


def test_a_resumed_call_whose_request_is_nowhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resume, "FIND_FOR_S", 0.1)

    async def body() -> None:
        pools = FakePools(1, 1)
        gen = DisaggregatedGenerator(
            pools,
            WordTokenizer(),
            RouterConfig(retry_delay_s=0.0),
        )
        gen.start()
        with pytest.raises(ResumeNotFoundError) as lost:
            async for _ in gen.generate(_call(3)):
                pass
        assert _failure_status(lost.value, "x")[0] == grpc.StatusCode.NOT_FOUND
        tokens: list[int] = []
        final = None
        async for item in gen.generate(_call(0)):
            if isinstance(item, TextChunk):
                tokens += item.token_ids
            else:
                final = item
        assert isinstance(final, FinalResult)
        assert tokens == tokens_after(PROMPT, 3, 6)  # run anew, from its first token
        assert gen.admission.num_in_flight == 0
        await gen.stop()

    asyncio.run(asyncio.wait_for(body(), 10))


def test_a_resumed_call_carries_its_token_count_to_the_core() -> None:
    from pdserve.v1 import generation_pb2 as pb
    from router.cli.client import build_request
    from router.edge.servicer import to_generate_call

    request = build_request(prompt="hi", resume_from_tokens=7)
    assert to_generate_call(request, request_id="r").resume_from_tokens == 7
    assert to_generate_call(build_request(prompt="hi"), request_id="r").resume_from_tokens is None
    assert replace(_call(None), resume_from_tokens=0).resume_from_tokens == 0
    assert pb.GenerateRequest(resume_from_tokens=0).HasField("resume_from_tokens")
