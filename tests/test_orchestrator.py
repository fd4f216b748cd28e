"""The router's serving core over fake workers: paths, retries, resumption after a lost
worker, stop strings, cancellation and lease renewal, in milliseconds."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import pytest

from bench.fake_workers import FakePools, tokens_after
from bench.harness import wait_until_async
from engine.core.outputs import FinalResult, TextChunk
from engine.core.request import FinishReason
from engine.sampling_params import SamplingParams
from router.serving.config import RouterConfig
from router.serving.orchestrator import DisaggregatedGenerator
from router.serving.protocol import GenerateCall
from tests.fakes import WordTokenizer

PROMPT = tuple(range(100, 164))  # 64 tokens: above the short-prompt threshold


def _call(max_tokens: int = 8, prompt: tuple[int, ...] = PROMPT, **sampling: Any) -> GenerateCall:
    params = SamplingParams(max_tokens=max_tokens, seed=3, ignore_eos=True, **sampling)
    return GenerateCall("", None, prompt, None, params)


def _generator(pools: FakePools, **config: Any) -> DisaggregatedGenerator:
    gen = DisaggregatedGenerator(
        pools,
        WordTokenizer(),
        RouterConfig(retry_delay_s=0.0, **config),
    )
    gen.start()
    return gen


async def _collect(stream: AsyncIterator[TextChunk | FinalResult]) -> tuple[list[int], FinalResult]:
    tokens: list[int] = []
    async for item in stream:
        if isinstance(item, TextChunk):
            tokens += item.token_ids
        else:
            return tokens, item
    raise AssertionError("no final result")


def _run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 10))


def _expected(call: GenerateCall) -> list[int]:
    return tokens_after(call.prompt_token_ids or (), 3, call.sampling.max_tokens)


async def _settle(pools: FakePools) -> None:
    """Until the background aborts (they run on the loop) left every worker empty."""
    await wait_until_async(
        lambda: all(f.holds_nothing for f in pools.fakes.values()),
        2.0,
        what="every fake worker holds nothing",
    )


def test_a_long_prompt_is_prefilled_remotely_and_decoded_with_the_same_tokens() -> None:
    async def body() -> None:
        pools = FakePools(1, 1)
        gen = _generator(pools)
        tokens, final = await _collect(gen.generate(_call()))
        assert final.finish_reason is FinishReason.LENGTH
        assert tokens == _expected(_call())
        verbs = [v for v, _ in pools.fakes["prefill-0"].calls]
        assert verbs == ["prefill"]
        decode_verbs = [v for v, _ in pools.fakes["decode-0"].calls]
        assert "reserve" in decode_verbs and "submit" not in decode_verbs
        assert final.timings.kv_transfer_s > 0 and not final.timings.local_prefill
        await _settle(pools)
        assert all(f.holds_nothing for f in pools.fakes.values())
        await gen.stop()

    _run(body())


def test_a_short_prompt_runs_on_the_decode_worker() -> None:
    async def body() -> None:
        pools = FakePools(1, 1)
        gen = _generator(pools)
        call = _call(prompt=(1, 2, 3))
        tokens, final = await _collect(gen.generate(call))
        assert tokens == _expected(call) and final.timings.local_prefill
        assert pools.fakes["prefill-0"].calls == []
        await gen.stop()

    _run(body())


def test_a_prefill_worker_that_dies_before_sending_falls_back_to_local_prefill() -> None:
    async def body() -> None:
        pools = FakePools(1, 1)
        pools.fakes["prefill-0"].die()
        gen = _generator(pools)
        tokens, final = await _collect(gen.generate(_call()))
        assert final.finish_reason is FinishReason.LENGTH, final.error
        assert tokens == _expected(_call()) and final.timings.local_prefill
        assert pools.workers["prefill"][0].state == "dead"
        await _settle(pools)
        assert pools.fakes["decode-0"].holds_nothing  # the reservation was given back
        await gen.stop()

    _run(body())


def test_a_refused_hand_off_after_the_first_token_resumes_without_repeating_it() -> None:
    async def body() -> None:
        pools = FakePools(1, 1)
        pools.fakes["decode-0"].refuse_kv = True
        gen = _generator(pools)
        tokens, final = await _collect(gen.generate(_call()))
        assert final.finish_reason is FinishReason.LENGTH, final.error
        assert tokens == _expected(_call())  # the first token once, then the rest
        assert final.usage.completion_tokens == 8
        await gen.stop()

    _run(body())


def test_no_room_on_decode_continues_in_its_own_queue_after_the_first_token() -> None:
    async def body() -> None:
        pools = FakePools(1, 1)
        pools.fakes["decode-0"].no_room = True
        gen = _generator(pools)
        tokens, final = await _collect(gen.generate(_call()))
        assert final.finish_reason is FinishReason.LENGTH, final.error
        assert tokens == _expected(_call())
        submits = [r for v, r in pools.fakes["decode-0"].calls if v == "submit"]
        assert len(submits) == 1 and submits[0] != _call().request_id
        await gen.stop()

    _run(body())


def test_a_decode_worker_that_dies_mid_stream_is_resumed_on_another() -> None:
    async def body() -> None:
        pools = FakePools(1, 2)
        gen = _generator(pools)
        call = _call(max_tokens=30)
        stream = gen.generate(call)
        tokens: list[int] = []
        final = None
        killed: list[str] = []
        async for item in stream:
            if isinstance(item, TextChunk):
                tokens += item.token_ids
                if len(tokens) >= 5 and not killed:
                    for ref in pools.workers["decode"]:
                        if pools.fakes[ref.worker_id].running:
                            pools.fakes[ref.worker_id].die()
                            killed.append(ref.worker_id)
            else:
                final = item
        assert final is not None and final.finish_reason is FinishReason.LENGTH, final
        assert tokens == _expected(call) and len(killed) == 1
        await gen.stop()

    _run(body())


def test_with_a_stream_interval_the_core_hands_out_tokens_a_message_at_a_time() -> None:
    """--stream-interval 4: after the first token the core's chunks carry at least 4
    tokens (the last one excepted), on the remote and the local path, and they are the
    request's tokens in order."""

    async def body() -> None:
        pools = FakePools(1, 1)
        gen = _generator(pools, stream_interval=4)
        for call in (_call(max_tokens=30), _call(max_tokens=30, prompt=(7, 8, 9))):
            sizes: list[int] = []
            tokens: list[int] = []
            final = None
            async for item in gen.generate(call):
                if isinstance(item, TextChunk):
                    sizes.append(len(item.token_ids))
                    tokens += item.token_ids
                else:
                    final = item
            assert final is not None and final.finish_reason is FinishReason.LENGTH
            assert tokens == _expected(call) and sizes[0] == 1, sizes
            assert all(size >= 4 for size in sizes[1:-1]), sizes
            assert len(sizes) <= 1 + 29 // 4 + 1, sizes
        await gen.stop()

    _run(body())


def test_auto_stream_interval_sends_tokens_one_by_one_alone_and_grouped_among_many() -> None:
    """One stream: a chunk per token. 40 streams at once (auto: 2 tokens a message from
    32 open streams on): most chunks after the first carry several tokens."""

    async def sizes_of(gen: DisaggregatedGenerator, call: GenerateCall) -> list[int]:
        sizes = []
        async for item in gen.generate(call):
            if isinstance(item, TextChunk):
                sizes.append(len(item.token_ids))
        return sizes

    async def body() -> None:
        pools = FakePools(1, 1, step_s=0.005)
        gen = _generator(pools)  # the default: auto
        alone = await sizes_of(gen, _call(max_tokens=12))
        assert alone == [1] * 12
        many = await asyncio.gather(*(sizes_of(gen, _call(max_tokens=24)) for _ in range(40)))
        assert all(sum(sizes) == 24 for sizes in many)
        later = [size for sizes in many for size in sizes[1:-1]]
        assert sum(size >= 2 for size in later) > 0.8 * len(later), later
        await gen.stop()

    _run(body())


def test_a_stop_string_ends_the_request_and_stops_the_decode_worker() -> None:
    async def body() -> None:
        pools = FakePools(1, 1)
        gen = _generator(pools)
        full = _expected(_call(max_tokens=20))
        stop = f"<{full[4]}>"
        tokens, final = await _collect(gen.generate(_call(max_tokens=20, stop=(stop,))))
        assert final.finish_reason is FinishReason.STOP
        assert tokens == full[:5]
        await _settle(pools)
        assert pools.fakes["decode-0"].holds_nothing
        await gen.stop()

    _run(body())


def test_a_cancelled_request_is_aborted_on_every_worker_it_reached() -> None:
    async def body() -> None:
        pools = FakePools(1, 1)
        hold = asyncio.Event()
        pools.fakes["prefill-0"].hold_prefill = hold
        gen = _generator(pools)
        stream = gen.generate(_call())
        assert isinstance(stream, AsyncGenerator)  # closable, as the servicer closes it
        task = asyncio.ensure_future(stream.__anext__())
        await wait_until_async(
            lambda: pools.fakes["prefill-0"].calls, 2.0, what="the prefill call arrived"
        )
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await stream.aclose()
        hold.set()
        await _settle(pools)
        for worker_id in ("prefill-0", "decode-0"):
            assert [v for v, _ in pools.fakes[worker_id].calls].count("abort") == 1, worker_id
        assert pools.fakes["decode-0"].holds_nothing
        assert all(ref.num_assigned == 0 for ref in pools.all())
        await gen.stop()

    _run(body())


def test_a_reservation_is_renewed_while_its_prefill_waits() -> None:
    async def body() -> None:
        pools = FakePools(1, 1)
        pools.fakes["prefill-0"].prefill_delay_s = 0.3
        gen = _generator(pools, lease_s=0.15)  # renewed every 0.05 s
        tokens, final = await _collect(gen.generate(_call()))
        assert final.finish_reason is FinishReason.LENGTH
        renewals = [r for v, r in pools.fakes["decode-0"].calls if v == "renew"]
        assert len(renewals) >= 3
        assert all(r == (renewals[0][0],) for r in renewals)
        await gen.stop()

    _run(body())


def test_a_prefill_past_its_timeout_ends_with_an_error_and_frees_both_workers() -> None:
    async def body() -> None:
        pools = FakePools(1, 1)
        pools.fakes["prefill-0"].prefill_delay_s = 5.0  # far past the timeout
        gen = _generator(pools, prefill_timeout_s=0.2, max_attempts=1)
        started = asyncio.get_running_loop().time()
        tokens, final = await _collect(gen.generate(_call()))
        assert asyncio.get_running_loop().time() - started < 2.0
        assert tokens == []
        assert final.finish_reason is FinishReason.ERROR
        assert "prefill took over 0.2 s" in final.error
        # The reservation taken beside the prefill call is given back, and the prefill
        # worker is told to drop the request.
        await _settle(pools)
        assert "abort" in [v for v, _ in pools.fakes["prefill-0"].calls]
        assert all(ref.num_assigned == 0 for ref in pools.all())
        await gen.stop()

    _run(body())


def test_when_every_attempt_fails_the_client_gets_one_error() -> None:
    async def body() -> None:
        pools = FakePools(1, 1)
        pools.fakes["decode-0"].refuse_kv = True
        pools.fakes["decode-0"].no_room = False
        gen = _generator(pools, max_attempts=1)
        tokens, final = await _collect(gen.generate(_call()))
        assert final.finish_reason is FinishReason.ERROR and "attempts" in final.error
        assert tokens == _expected(_call())[:1]  # what was streamed stays streamed
        assert all(ref.num_assigned == 0 for ref in pools.all())
        await gen.stop()

    _run(body())


def test_the_same_request_gives_the_same_tokens_whatever_the_path() -> None:
    async def body() -> None:
        call = _call(max_tokens=12)
        results = []
        for setup in ("remote", "refused", "prefill_dead"):
            pools = FakePools(1, 1)
            if setup == "refused":
                pools.fakes["decode-0"].refuse_kv = True
            if setup == "prefill_dead":
                pools.fakes["prefill-0"].die()
            gen = _generator(pools)
            results.append((await _collect(gen.generate(call)))[0])
            await gen.stop()
        assert results[0] == results[1] == results[2]
        assert results[0] == tokens_after(PROMPT, call.sampling.seed or 0, call.sampling.max_tokens)

    _run(body())


def test_a_stop_string_that_spans_the_resume_point_still_stops_the_request() -> None:
    async def body() -> None:
        pools = FakePools(1, 1)
        pools.fakes["decode-0"].refuse_kv = True  # resumes right after the first token
        gen = _generator(pools)
        full = _expected(_call(max_tokens=20))
        stop = f"<{full[0]}><{full[1]}>"  # the prefill's token, then the resumed one
        tokens, final = await _collect(gen.generate(_call(max_tokens=20, stop=(stop,))))
        assert final.finish_reason is FinishReason.STOP, final.error
        assert tokens == full[:2]
        await _settle(pools)
        assert all(f.holds_nothing for f in pools.fakes.values())
        await gen.stop()

    _run(body())


def test_a_reservation_is_renewed_until_its_kv_lands() -> None:
    async def body() -> None:
        pools = FakePools(1, 1)
        pools.fakes["prefill-0"].prefill_delay_s = 0.2
        # The KV lands well past the lease after the prefill answered: still progress.
        pools.fakes["prefill-0"].kv_delay_s = 0.3
        gen = _generator(pools, lease_s=0.1)
        tokens, final = await _collect(gen.generate(_call()))
        assert final.finish_reason is FinishReason.LENGTH, final.error
        assert tokens == _expected(_call())
        # The hand-off itself was accepted: nothing ran the prompt again on decode.
        assert [v for v, _ in pools.fakes["decode-0"].calls].count("submit") == 0
        await _settle(pools)
        assert all(f.holds_nothing for f in pools.fakes.values())
        await gen.stop()

    _run(body())


def test_an_expired_reservation_is_retried_on_decode_not_failed() -> None:
    async def body() -> None:
        pools = FakePools(1, 1)
        pools.fakes["prefill-0"].kv_delay_s = 0.3
        gen = _generator(pools, lease_s=0.1)
        gen.leases.renewing = defaultdict(_Forgetful)
        tokens, final = await _collect(gen.generate(_call()))
        assert final.finish_reason is FinishReason.LENGTH, final.error
        assert tokens == _expected(_call())  # the first token once, then the rest
        submits = [r for v, r in pools.fakes["decode-0"].calls if v == "submit"]
        assert len(submits) == 1  # continued from its first token on the decode worker
        await _settle(pools)
        assert all(f.holds_nothing for f in pools.fakes.values())
        await gen.stop()

    _run(body())


class _Forgetful(set[str]):
    """A renewal set that never holds anything: the lease is left to expire."""

    def add(self, element: str) -> None:
        pass


def test_a_fake_workers_tokens_follow_from_every_token_before_them() -> None:
    """So a continuation built from wrong tokens cannot pass for the undisturbed text:
    prompt plus the first k tokens gives the rest; any other context does not."""
    tokens = tokens_after(PROMPT, 3, 20)
    assert tokens_after(PROMPT + tuple(tokens[:8]), 3, 12) == tokens[8:]
    wrong = [(*tokens[:7], tokens[0]), tokens[:7], (*tokens[:3], 0, *tokens[4:8])]
    for context in wrong:
        assert tokens_after(PROMPT + tuple(context), 3, 12) != tokens[8:]
    assert tokens_after((*PROMPT[:-1], 0), 3, 20) != tokens  # and so does the prompt
