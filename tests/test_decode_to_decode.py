"""A running request handed from one decode worker to another, KV and all, over their own
gloo channel (the path a draining worker's requests take).

The two workers are driven in-process (no Ray), as the router drives them: detach on the
source, reserve on the target, send the detached KV. The request continues on the target
with the tokens an undisturbed run gives, greedy and seeded, and neither worker keeps a
block.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from torch.distributed import TCPStore

from decode_worker.worker import DecodeWorker
from engine.factory import EngineArgs
from engine.sampling_params import SamplingParams
from engine.wire import ChannelSpec, DetachedMove, GenerationInput, HandoffTarget, Precopy

ARGS = EngineArgs(kv_cache_gib=0.05)
MAX_TOKENS = 400  # long enough to be running still when the test detaches it
MORE = 8  # tokens asked of the target after the move
PROMPT = tuple(100 + (i * 37) % 5000 for i in range(40))
SAMPLING = {
    "greedy": SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
    "seeded": SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.9, top_k=50, seed=11, ignore_eos=True
    ),
}


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def workers(
    loop: asyncio.AbstractEventLoop, smollm2_path: Path
) -> Iterator[tuple[DecodeWorker, DecodeWorker]]:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    async def start() -> tuple[DecodeWorker, DecodeWorker]:
        # The source schedules one step ahead, as decode engines do on GPUs: it is
        # detached with a step in flight (whose next block is already allocated).
        source = DecodeWorker(replace(ARGS, async_scheduling=True), 0)
        target = DecodeWorker(ARGS, 1)
        # One after the other: importing transformers from two threads at once races.
        await source.start()
        await target.start()
        assert source.core.async_scheduling and not target.core.async_scheduling
        spec = ChannelSpec(
            "127.0.0.1", store.port, "decode-0", source.epoch, "decode-1", target.epoch
        )
        await asyncio.gather(source.connect(spec), target.connect(spec))
        return source, target

    pair = loop.run_until_complete(start())
    yield pair
    for worker in pair:
        loop.run_until_complete(worker.shutdown())


async def _tokens(
    worker: DecodeWorker, want: dict[str, int], timeout: float = 60
) -> dict[str, list[int]]:
    """Tokens of each request id until it has `want[id]` of them (or it finished)."""
    got: dict[str, list[int]] = {req_id: [] for req_id in want}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while any(len(got[r]) < n for r, n in want.items()):
        assert loop.time() < deadline, f"not enough tokens: {got}"
        batch = await worker.next_tokens(0.2)
        for update in batch.updates:
            if update.req_id in got:
                assert update.finish_reason is None or update.new_token_ids or got[update.req_id]
                got[update.req_id] += update.new_token_ids
    return got


async def _blocks_in_use(*workers: DecodeWorker) -> list[int]:
    return [(await w.load()).num_blocks_in_use for w in workers]


def test_running_requests_move_with_their_kv_and_go_on_unchanged(
    loop: asyncio.AbstractEventLoop, workers: tuple[DecodeWorker, DecodeWorker]
) -> None:
    """Greedy and seeded requests move in one message, each either in one round or in
    two: its full blocks first while it keeps decoding (`precopy`), then, detached, only
    the blocks after them."""
    source, target = workers
    target_ref = HandoffTarget("decode-1", target.epoch)
    # (id, sampling, pre-copied first)
    cases = [
        (f"{kind}-{'pc' if pre else 'whole'}", sampling, pre)
        for kind, sampling in SAMPLING.items()
        for pre in (False, True)
    ]
    pre_copied = [req_id for req_id, _, pre in cases if pre]

    async def body() -> None:
        for req_id, sampling, _ in cases:
            await source.submit(GenerationInput(req_id, PROMPT, sampling))
        streamed = await _tokens(source, {req_id: 4 for req_id, _, _ in cases})
        sent = await source.precopy(target_ref, [Precopy(i, f"{i}-k1") for i in pre_copied])
        # 44 or more tokens computed: at least two full blocks of 16 each.
        assert set(sent) == {f"{i}-k1" for i in pre_copied} and min(sent.values()) >= 2
        await _tokens(source, {req_id: 4 for req_id, _, _ in cases})  # they decode on
        # All detached at one step boundary, all reserved for in one call, as a drain does.
        detached_all = await source.detach([req_id for req_id, _, _ in cases])
        outputs, totals, inputs = {}, {}, []
        for (req_id, sampling, _), detached in zip(cases, detached_all, strict=True):
            assert detached is not None, req_id
            outputs[req_id] = list(detached.token_ids[len(PROMPT) :])
            # Whatever the source sampled by then, the stream so far is a prefix of it.
            assert outputs[req_id][: len(streamed[req_id])] == streamed[req_id]
            totals[req_id] = len(outputs[req_id]) + MORE  # it now ends MORE tokens on
            inputs.append(
                GenerationInput(
                    f"{req_id}-k1",
                    detached.token_ids[: detached.num_kv_tokens],
                    replace(sampling, max_tokens=MORE + 1),
                )
            )
        reservations = await target.reserve_many(inputs, 30.0, "decode-0")
        moves = []
        for (req_id, _, _), moved, detached, reservation in zip(
            cases, inputs, detached_all, reservations, strict=True
        ):
            assert reservation is not None and detached is not None
            assert reservation.num_precopied == sent.get(moved.req_id, 0)
            moves.append(DetachedMove(req_id, moved.req_id, detached, reservation.num_precopied))
        # All in one transfer (one message: one gather, one header with an entry each),
        # without the blocks a pre-copy sent.
        num_bytes = await source.send_detached(target_ref, moves)
        assert num_bytes == sum(
            (-(-m.detached.num_kv_tokens // 16) - m.skip_blocks) * source.block_bytes for m in moves
        )
        rest = await _tokens(target, {f"{req_id}-k1": MORE for req_id, _, _ in cases})
        for req_id, sampling, _ in cases:
            # The same request undisturbed, on the target itself.
            ref_id = f"ref-{req_id}"
            limited = replace(sampling, max_tokens=totals[req_id])
            await target.submit(GenerationInput(ref_id, PROMPT, limited))
            reference = await _tokens(target, {ref_id: totals[req_id]})
            assert outputs[req_id] + rest[f"{req_id}-k1"] == reference[ref_id], req_id
        assert await source.detach([cases[0][0]]) == [None]  # gone from the source
        loop_ = asyncio.get_running_loop()
        deadline = loop_.time() + 10
        while await _blocks_in_use(source, target) != [0, 0]:
            assert loop_.time() < deadline, await _blocks_in_use(source, target)
            await asyncio.sleep(0.05)

    loop.run_until_complete(body())


def test_a_detached_request_that_cannot_move_gives_its_blocks_back(
    loop: asyncio.AbstractEventLoop, workers: tuple[DecodeWorker, DecodeWorker]
) -> None:
    source, _ = workers

    async def body() -> None:
        await source.submit(GenerationInput("stays", PROMPT, SAMPLING["greedy"]))
        await _tokens(source, {"stays": 3})
        assert (await source.detach(["stays"]))[0] is not None
        assert (await source.load()).num_blocks_in_use > 0  # kept for the move
        await source.abort("stays")  # the router gave up on moving it
        assert await _blocks_in_use(source) == [0]

    loop.run_until_complete(body())
