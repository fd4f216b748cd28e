"""Migration on worker death: a request whose decode (or colocated) worker dies after the
client saw tokens goes on elsewhere, as one uninterrupted stream with the undisturbed
text, up to --max-migrations times.

The serving core runs over fake workers (whose token depends only on seed and position,
as the real sampler's does); the real sampler and detokenizer are checked on a tiny
model with the embedded tokenizer: a continuation (prompt plus streamed tokens, the
rest asked for, same seed) gives the undisturbed run's tokens, and the stop-string
matcher finds a stop string that spans the migration point."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from bench.fake_workers import FakePools, tokens_after
from engine.core.outputs import FinalResult, TextChunk
from engine.core.request import FinishReason
from engine.frontend.output_processor import OutputProcessor
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from router.fleet.worker_state import WorkerState
from router.observability import metrics
from router.observability.serving_metrics import migrations_counter
from router.serving.protocol import GenerateCall
from tests.test_orchestrator import PROMPT, _call, _generator, _run, _settle

SEED = 3


_TOKENS = tokens_after(PROMPT, SEED, 256)


def _token(k: int) -> int:
    """The k-th output token of PROMPT under SEED, as any fake worker samples it."""
    return _TOKENS[k]


def _text(tokens: list[int]) -> str:
    return "".join(f"<{t}>" for t in tokens)


def _migrations(pool: str = "decode") -> float:
    migrations_counter()
    labels = {"pool": pool, "reason": "worker_died"}
    value = metrics.get_metrics().registry.get_sample_value(
        "pdserve_request_migrations_total", labels
    )
    return value or 0.0


async def _stream(gen: Any, call: GenerateCall) -> tuple[list[int], str, FinalResult]:
    tokens: list[int] = []
    text = ""
    async for item in gen.generate(call):
        if isinstance(item, TextChunk):
            tokens += item.token_ids
            text += item.text
        else:
            return tokens, text, item
    raise AssertionError("no final result")


def _dies_after(pools: FakePools, worker_id: str, k: int) -> None:
    """`worker_id` dies right after it streamed output token number k of PROMPT."""
    pools.fakes[worker_id].die_after_position = len(PROMPT) + k


@pytest.mark.parametrize("where", ["decode", "colocated"])
def test_a_worker_killed_mid_stream_continues_elsewhere_with_the_same_text(where: str) -> None:
    async def body() -> None:
        pools = FakePools(1, 2) if where == "decode" else FakePools(0, 0, 2)
        first = f"{where}-0"
        for ref in pools.workers[where][1:]:
            ref.state = WorkerState.STARTING  # not routable: the request starts on worker 0
        _dies_after(pools, first, 9)
        gen = _generator(pools)
        before = _migrations(where)
        call = _call(max_tokens=30)
        stream = _stream(gen, call)
        task = asyncio.ensure_future(stream)
        while not pools.fakes[first].dead:
            await asyncio.sleep(0.001)
        for ref in pools.workers[where][1:]:
            ref.state = WorkerState.LIVE
        tokens, text, final = await task
        assert final.finish_reason is FinishReason.LENGTH, final.error
        assert tokens == [_token(k) for k in range(30)]  # none missing, none twice
        assert text == _text(tokens)
        assert final.usage.prompt_tokens == len(PROMPT)
        assert final.usage.completion_tokens == 30
        assert _migrations(where) == before + 1
        assert all(f.holds_nothing for f in pools.fakes.values() if not f.dead)
        await gen.stop()

    _run(body())


def test_a_request_waiting_for_a_replacement_is_woken_by_the_replacement_itself() -> None:
    """The only decode worker dies mid-stream on a quiet service: its replacement's going
    live resumes the stream, with no other request to start the replacement's poll."""

    async def body() -> None:
        pools = FakePools(1, 1)
        _dies_after(pools, "decode-0", 9)
        gen = _generator(pools)
        streamed: list[int] = []

        async def client() -> FinalResult:
            async for item in gen.generate(_call(max_tokens=30)):
                if isinstance(item, FinalResult):
                    return item
                streamed.extend(item.token_ids)
            raise AssertionError("no final result")

        task = asyncio.ensure_future(client())
        while not pools.fakes["decode-0"].dead:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.3)  # nothing to route to: the request waits for a worker
        assert len(streamed) == 10 and not task.done()
        pools.replace("decode-0")
        # The 20 tokens left take 40 ms of fake steps once the replacement is followed.
        await asyncio.wait([task], timeout=2.0)
        assert task.done(), f"{len(streamed)} of 30 tokens 2 s after the replacement went live"
        final = task.result()
        assert final.finish_reason is FinishReason.LENGTH, final.error
        assert streamed == [_token(k) for k in range(30)]
        await _settle(pools)
        await gen.stop()

    _run(body())


def test_a_stop_string_that_spans_the_migration_point_stops_there() -> None:
    async def body() -> None:
        pools = FakePools(1, 2)
        pools.workers["decode"][1].state = WorkerState.STARTING
        _dies_after(pools, "decode-0", 9)  # tokens 0..9 from decode-0, 10.. elsewhere
        gen = _generator(pools)
        # The tail of token 9's text and the head of token 10's: neither worker alone
        # produced it; the router's matcher must have kept what was streamed.
        stop = _text([_token(9)])[-3:] + _text([_token(10)])[:3]
        task = asyncio.ensure_future(_stream(gen, _call(max_tokens=30, stop=(stop,))))
        while not pools.fakes["decode-0"].dead:
            await asyncio.sleep(0.001)
        pools.workers["decode"][1].state = WorkerState.LIVE
        tokens, text, final = await task
        assert final.finish_reason is FinishReason.STOP, final.error
        assert tokens == [_token(k) for k in range(11)]
        full = _text(tokens)
        assert text == full[: full.index(stop)]
        assert final.usage.completion_tokens == 11
        await gen.stop()

    _run(body())


def test_a_migration_target_that_dies_too_moves_the_request_again() -> None:
    async def body() -> None:
        pools = FakePools(1, 3)
        for ref in pools.workers["decode"][1:]:
            ref.state = WorkerState.STARTING
        _dies_after(pools, "decode-0", 4)
        _dies_after(pools, "decode-1", 12)
        gen = _generator(pools)
        before = _migrations()
        task = asyncio.ensure_future(_stream(gen, _call(max_tokens=24)))
        for worker in ("decode-0", "decode-1"):
            while not pools.fakes[worker].dead:
                await asyncio.sleep(0.001)
            # The next worker opens only now, so the request lands on it.
            pools.workers["decode"][int(worker[-1]) + 1].state = WorkerState.LIVE
        tokens, _, final = await task
        assert final.finish_reason is FinishReason.LENGTH, final.error
        assert tokens == [_token(k) for k in range(24)]
        assert _migrations() == before + 2
        await gen.stop()

    _run(body())


@pytest.mark.parametrize("max_migrations", [0, 1])
def test_past_the_migration_limit_the_request_ends_with_one_clear_error(
    max_migrations: int,
) -> None:
    async def body() -> None:
        pools = FakePools(1, 3)
        for index, k in enumerate((5, 10, 15)):
            _dies_after(pools, f"decode-{index}", k)
        for ref in pools.workers["decode"][1:]:
            ref.state = WorkerState.STARTING
        gen = _generator(pools, max_migrations=max_migrations)
        task = asyncio.ensure_future(_stream(gen, _call(max_tokens=24)))
        for index in range(2):
            while not pools.fakes[f"decode-{index}"].dead and not task.done():
                await asyncio.sleep(0.001)
            pools.workers["decode"][index + 1].state = WorkerState.LIVE
        tokens, _, final = await task
        assert final.finish_reason is FinishReason.ERROR
        assert f"--max-migrations {max_migrations}" in final.error
        assert "after" in final.error and "tokens" in final.error
        # What was streamed stays streamed, and usage counts it.
        streamed = 6 if max_migrations == 0 else 11
        assert tokens == [_token(k) for k in range(streamed)]
        assert final.usage.completion_tokens == streamed
        await asyncio.sleep(0.01)  # background aborts
        assert all(ref.num_assigned == 0 for ref in pools.all())
        await gen.stop()

    _run(body())


def test_the_migrations_metric_is_exported_from_the_start() -> None:
    from prometheus_client import generate_latest

    async def body() -> None:
        gen = _generator(FakePools(1, 1))
        await gen.stop()

    _run(body())
    text = generate_latest(metrics.get_metrics().registry).decode()
    assert 'pdserve_request_migrations_total{pool="decode",reason="worker_died"}' in text
    assert 'pdserve_request_migrations_total{pool="colocated",reason="drained"}' in text


# ---------------------------------------------------------------- the real sampler


def test_a_continuation_gives_the_undisturbed_text_and_stop(
    tiny_model_paths: dict[str, Path],
) -> None:
    """Greedy and seeded: prompt plus the first k tokens, the rest asked for with the same
    seed, continues with the undisturbed tokens (the sampler's position is absolute)."""
    from engine.factory import EngineArgs

    reference_llm = LLM(EngineArgs(model=str(tiny_model_paths["llama"]), num_blocks=64))
    tokenizer = reference_llm.tokenizer
    assert tokenizer is not None
    prompt_ids = tokenizer.encode("Once upon a time, in a small village,")
    greedy = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)
    seeded = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.9, top_k=50, seed=7)
    k = 5  # the client saw 5 tokens when the worker died
    undisturbed = reference_llm.generate([prompt_ids] * 2, [greedy, seeded])
    heads = [list(out.token_ids[:k]) for out in undisturbed]
    rest = reference_llm.generate(
        [prompt_ids + head for head in heads],
        [replace(greedy, max_tokens=12 - k), replace(seeded, max_tokens=12 - k)],
    )
    for out, head, tail in zip(undisturbed, heads, rest, strict=True):
        assert head + list(tail.token_ids) == list(out.token_ids)

    # The router's matcher, fed what each worker streamed, stops at a stop string that
    # spans the point where the second worker took over.
    tokens = list(undisturbed[1].token_ids)
    before = tokenizer.decode(tokens[:k])
    full = tokenizer.decode(tokens)
    stop = full[len(before) - 2 : len(before) + 2]
    outputs = OutputProcessor(tokenizer, tuple(prompt_ids), (stop,))
    text = ""
    reason = None
    for token in tokens:
        chunk, finish_reason = outputs.process((token,), None)
        text += chunk.text if chunk else ""
        if finish_reason is not None:
            reason = finish_reason
            break
    assert reason is FinishReason.STOP
    assert text == full[: full.index(stop)]


def test_a_worker_lost_while_the_service_shuts_down_ends_its_streams_with_abort() -> None:
    async def body() -> None:
        pools = FakePools(1, 2)
        _dies_after(pools, "decode-0", 4)
        _dies_after(pools, "decode-1", 4)
        gen = _generator(pools)
        before = _migrations()
        gen.begin_shutdown()
        tokens, _, final = await _stream(gen, _call(max_tokens=24))
        assert final.finish_reason is FinishReason.ABORT
        assert "shutting down" in final.error
        assert tokens == [_token(k) for k in range(5)]
        assert _migrations() == before  # nowhere to move that outlives the drain
        await gen.stop()

    _run(body())
