"""A router that knows the caches (2 prefill + 1 decode on CPU): a session's next turn
lands where its history is cached, short prompts skip the hand-off, urgent requests
overtake a full batch."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from bench.harness import ServiceProcess
from bench.harness.streams import StreamResult, generate
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from pdserve.v1 import generation_pb2 as pb
from tests.services import StartService

pytestmark = pytest.mark.e2e

FOLLOW_UP = (
    " And what about its mountains, lakes, forests, deserts and coastlines? Describe each"
    " of them in turn, with two examples for every one."
)
SYSTEM = "You are a careful assistant who answers questions about geography in detail. "


@pytest.fixture(scope="module")
def service(start_service: StartService, ray_session: str) -> ServiceProcess:
    return start_service(
        [
            "--ray-address",
            ray_session,
            "--prefill-workers",
            "2",
            "--prefill-kv-cache-gib",
            "0.1",
            "--decode-kv-cache-gib",
            "0.1",
            "--decode-max-num-seqs",
            "2",
            "--decode-policy",
            "priority",
            "--local-prefill-max-tokens",
            "24",
            # A TTFT target no burst here reaches: the prefill pool never counts as
            # saturated, so a prompt runs on the decode worker only for being short (a
            # first turn run there would leave its history on the decode worker, and its
            # next turn, with more new tokens than the short-prompt floor, would go to an
            # idle prefill worker that holds none of it).
            "--slo-ttft-ms",
            "60000",
        ],
        name="svc-routing",
    )


async def _run(address: str, decoding: asyncio.Event | None = None, **kwargs: Any) -> StreamResult:
    """Greedy, full length; `decoding` is set at the second token (the first may come from
    a prefill worker, the second comes from the decode worker)."""

    def progress(num_tokens: int) -> None:
        if decoding is not None and num_tokens >= 2:
            decoding.set()

    result = await generate(address, temperature=0.0, ignore_eos=True, on_tokens=progress, **kwargs)
    assert result.code == grpc.StatusCode.OK and result.final is not None, result
    return result


def _final(result: StreamResult) -> pb.GenerateResponse:
    assert result.final is not None
    return result.final


def test_next_turn_lands_where_its_history_is_cached(service: ServiceProcess) -> None:
    # Each session's own part is long, so the worker holding its history wins on the
    # work left, whatever the workers' measured speeds (noisy on a loaded machine).
    sessions = [
        SYSTEM
        + f"Session {i}: tell me about these rivers of country number {i}: "
        + ", ".join(f"river {i}-{k}" for k in range(24))
        + "."
        for i in range(4)
    ]

    async def scenario() -> None:
        # First turns at once: they spread over both prefill workers.
        firsts = await asyncio.gather(
            *(_run(service.address, prompt=p, max_tokens=8) for p in sessions)
        )
        for history, first_turn in zip(sessions, firsts, strict=True):
            first = _final(first_turn)
            prompt_tokens = first.usage.prompt_tokens
            # The next turn extends the history; it must find all of it but the
            # last partial block cached where it runs: the prefill worker that ran the
            # first turn, or the decode worker that holds its KV (the rule may run the
            # few new tokens there).
            second_turn = await _run(service.address, prompt=history + FOLLOW_UP, max_tokens=4)
            second = _final(second_turn)
            assert second.usage.cached_prompt_tokens >= prompt_tokens - 16, (
                first.usage,
                second.usage,
            )

    asyncio.run(scenario())


def test_short_prompt_takes_the_local_path(service: ServiceProcess, reference_llm: LLM) -> None:
    prompt = "Name three colours."
    result = asyncio.run(_run(service.address, prompt=prompt, max_tokens=12))
    final = _final(result)
    assert final.finish_reason == pb.FINISH_REASON_LENGTH
    assert final.timings.local_prefill
    assert final.timings.kv_transfer_seconds == 0 and final.timings.prefill_seconds == 0
    expected = reference_llm.generate(
        [prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    )
    assert result.tokens == list(expected[0].token_ids)


def test_urgent_request_overtakes_a_full_batch(service: ServiceProcess) -> None:
    async def scenario() -> None:
        # Two long, unimportant requests fill the decode worker's batch (2 sequences).
        # The urgent one comes once both decode, not after a fixed wait: then each long
        # one has dozens of steps left against the urgent one's few on any machine.
        decoding = [asyncio.Event() for _ in range(2)]
        slow = [
            asyncio.ensure_future(
                _run(
                    service.address,
                    decoding=decoding[i],
                    prompt=f"Count slowly {i}.",
                    max_tokens=40,
                    priority=5,
                )
            )
            for i in range(2)
        ]
        await asyncio.wait_for(asyncio.gather(*(d.wait() for d in decoding)), 120)
        urgent = await _run(service.address, prompt="Quick: say yes.", max_tokens=4, priority=-5)
        assert _final(urgent).finish_reason == pb.FINISH_REASON_LENGTH
        results = await asyncio.gather(*slow)
        # It did not wait for a slot: it finished while both long ones were still running,
        # and they still completed (the preempted one recomputed its tokens).
        assert all(r.done_at > urgent.done_at for r in results)
        assert all(_final(r).finish_reason == pb.FINISH_REASON_LENGTH for r in results)
        assert all(len(r.tokens) == 40 for r in results)

    asyncio.run(scenario())
