"""KV hand-off between a prefill and a decode worker over their own gloo channel.

The workers are driven in-process (no Ray): the protocol is the same, and every
guarantee is checked where it is made: bit-identical blocks, refusal of stale or
mismatched hand-offs with the channel still in step, aborts during a transfer, lease
expiry, and no block left in use. Every test runs twice: KV sent in one message after
the prefill pass, and streamed layer by layer during it.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Coroutine, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed import TCPStore

from bench.harness import wait_until_async
from decode_worker.worker import DecodeWorker
from engine.core.config import SchedulerConfig
from engine.core.request import FinishReason
from engine.factory import EngineArgs
from engine.sampling_params import SamplingParams
from engine.transfer.base import PairChannel
from engine.transfer.channel import KVChannel
from engine.transfer.sender import Message
from engine.wire import (
    NO_TOKEN,
    ChannelSpec,
    GenerationInput,
    HandoffEntry,
    HandoffHeader,
    HeaderKind,
    Reservation,
    TokenUpdate,
)
from prefill_worker.worker import PrefillWorker

ARGS = EngineArgs(kv_cache_gib=0.05, scheduler=SchedulerConfig(long_prefill_token_threshold=16))


class Pair:
    def __init__(self, prefill: PrefillWorker, decode: DecodeWorker, streamed: bool) -> None:
        self.prefill = prefill
        self.decode = decode
        self.streamed = streamed

    async def updates_for(self, req_id: str, timeout: float = 20.0) -> list[TokenUpdate]:
        """Every update for req_id until it finishes (other requests' are dropped)."""
        seen: list[TokenUpdate] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            batch = await self.decode.next_tokens(0.2)
            seen += [u for u in batch.updates if u.req_id == req_id]
            if seen and seen[-1].finish_reason is not None:
                return seen
        raise AssertionError(f"{req_id} did not finish: {seen}")

    async def blocks_in_use(self) -> tuple[int, int]:
        p, d = await asyncio.gather(self.prefill.load(), self.decode.load())
        return p.num_blocks_in_use, d.num_blocks_in_use

    async def wait_zero(self, timeout: float = 10.0) -> None:
        async def empty() -> bool:
            return await self.blocks_in_use() == (0, 0)

        await wait_until_async(empty, timeout, interval=0.05, what="both pools hold no block")


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module", params=["whole", "streamed"])
def pair(
    loop: asyncio.AbstractEventLoop, smollm2_path: Path, request: pytest.FixtureRequest
) -> Iterator[Pair]:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    streamed = request.param == "streamed"
    prefill_args = replace(ARGS, kv_stream_min_tokens=0 if streamed else 10**6)

    async def start() -> Pair:
        prefill, decode = PrefillWorker(prefill_args, 0), DecodeWorker(ARGS, 0)
        # One after the other: importing transformers from two threads at once races.
        p_info = await prefill.start()
        d_info = await decode.start()
        spec = ChannelSpec(
            "127.0.0.1", store.port, "prefill-0", p_info.epoch, "decode-0", d_info.epoch
        )
        await asyncio.gather(prefill.connect(spec), decode.connect(spec))
        return Pair(prefill, decode, streamed)

    p = loop.run_until_complete(start())
    yield p
    loop.run_until_complete(p.prefill.shutdown())
    loop.run_until_complete(p.decode.shutdown())


def _input(req_id: str, num_tokens: int, max_tokens: int = 4) -> GenerationInput:
    prompt = tuple(100 + (i * 37) % 5000 for i in range(num_tokens))
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, seed=7)
    return GenerationInput(req_id, prompt, sampling)


def run(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, None]) -> None:
    loop.run_until_complete(coro)


class SentBlocks:
    """The KV a prefill worker gathers for its messages, as it was when gathered (whole
    messages and streamed parts alike: every payload leaves through `gather_blocks`).
    The worker frees a prompt's last, partial block once it is handed off, so this is
    the only record of what that block held when it left."""

    def __init__(self, worker: PrefillWorker) -> None:
        self._runner = worker.runner
        self._gather = worker.runner.gather_blocks
        self._gathered: list[tuple[list[int], tuple[int, int] | None, torch.Tensor]] = []

    def __enter__(self) -> SentBlocks:
        def recording(
            block_ids: Any,
            layers: tuple[int, int] | None = None,
            heads: tuple[int, int] | None = None,
        ) -> torch.Tensor:
            assert heads is None, "one-process workers send every head"
            payload = self._gather(block_ids, layers)
            ids = block_ids.tolist() if isinstance(block_ids, torch.Tensor) else list(block_ids)
            self._gathered.append((ids, layers, payload.clone()))
            return payload

        self._runner.gather_blocks = recording
        return self

    def __exit__(self, *exc: object) -> None:
        del self._runner.gather_blocks

    def blocks(self) -> torch.Tensor:
        """Every block sent, in the order first sent, each as its last payload left it."""
        num_layers = self._runner.kv_cache.shape[1]
        order = list(dict.fromkeys(i for ids, _, _ in self._gathered for i in ids))
        out = torch.zeros((len(order), *self._runner.kv_cache.shape[1:]))
        covered = [[False] * num_layers for _ in order]
        for ids, layers, payload in self._gathered:
            start, stop = layers or (0, num_layers)
            for row, block_id in enumerate(ids):
                at = order.index(block_id)
                out[at, start:stop] = payload[row]
                covered[at][start:stop] = [True] * (stop - start)
        assert all(all(layers) for layers in covered), "a block was sent without every layer"
        return out.to(self._runner.kv_cache.dtype)


def _cached_block_ids(worker: PrefillWorker, prompt: list[int]) -> list[int]:
    """The blocks of `prompt` in the worker's prefix cache (run on its engine thread)."""
    return [b.block_id for b in worker.core.scheduler.kv.find_cached_prefix(prompt)]


def test_decode_blocks_are_bit_identical_to_prefill_blocks(
    loop: asyncio.AbstractEventLoop, pair: Pair
) -> None:
    async def body() -> None:
        for req_id, n in (("a", 70), ("b", 32), ("c", 5)):
            inp = _input(req_id, n)
            res = await pair.decode.reserve(inp)
            assert res is not None and len(res.block_ids) == -(-n // 16)
            with SentBlocks(pair.prefill) as sent:
                result = await pair.prefill.prefill(inp, res)
                assert result.finish_reason is None, result.error
                assert result.transfer_bytes > 0
                updates = await pair.updates_for(req_id)  # the KV has left by now
            # Every block, the last partial one included, holds what left the prefill
            # worker: all of a full block; a partial block's prompt rows (the decode
            # worker writes its own tokens' KV behind them).
            src, dst = sent.blocks(), await pair.decode.read_blocks(list(res.block_ids))
            assert src.shape == dst.shape, req_id
            num_last = n - 16 * (len(res.block_ids) - 1)
            assert torch.equal(src[:-1], dst[:-1]), req_id
            assert torch.equal(src[-1, :, :, :num_last], dst[-1, :, :, :num_last]), req_id
            assert src[-1, :, :, :num_last].abs().sum() > 0, req_id
            assert updates[0].kv_wire_s > 0  # arrival is reported once, before tokens
            assert sum(len(u.new_token_ids) for u in updates) == 3  # 4 minus prefill's first
            # Full prompt blocks stay in the prefill worker's prefix cache after the
            # hand-off; the decode worker's copies must hold the same bits.
            full = n // 16
            src_ids = await pair.prefill.on_engine(
                functools.partial(_cached_block_ids, pair.prefill, list(inp.prompt_token_ids))
            )
            # (a lookup always leaves one token to compute, so a prompt of exactly k full
            # blocks finds k - 1 of them)
            num_compared = min(full, len(src_ids))
            assert num_compared >= full - 1
            if num_compared:
                src = await pair.prefill.read_blocks(src_ids[:num_compared])
                dst = await pair.decode.read_blocks(list(res.block_ids[:num_compared]))
                assert torch.equal(src, dst), req_id
                assert src.abs().sum() > 0
        await pair.wait_zero()

    run(loop, body())


@pytest.mark.parametrize("tamper", ["epoch", "tokens"])
def test_stale_or_mismatched_handoff_is_refused_and_the_channel_stays_in_step(
    loop: asyncio.AbstractEventLoop, pair: Pair, tamper: str
) -> None:
    async def body() -> None:
        inp = _input(f"t-{tamper}", 40)
        res = await pair.decode.reserve(inp)
        assert res is not None
        target: Reservation = res
        if tamper == "epoch":
            target = replace(res, epoch=res.epoch ^ 0xFF)
        else:  # KV for another prompt than the one the reservation was made for
            inp = _input(inp.req_id, 24)
        result = await pair.prefill.prefill(inp, target)
        assert result.finish_reason is None  # sent: the receiver is the one that checks
        updates = await pair.updates_for(inp.req_id)
        assert updates[-1].finish_reason is FinishReason.ERROR
        assert "refused" in updates[-1].error
        await pair.decode.abort(inp.req_id)  # the router does this on error
        await pair.wait_zero()
        # The channel is still in step: a good hand-off right after works.
        good = _input(f"after-{tamper}", 20)
        res = await pair.decode.reserve(good)
        assert res is not None
        assert (await pair.prefill.prefill(good, res)).finish_reason is None
        updates = await pair.updates_for(good.req_id)
        assert updates[-1].finish_reason is FinishReason.LENGTH
        await pair.wait_zero()

    run(loop, body())


def test_abort_during_import_and_expired_lease_free_every_block(
    loop: asyncio.AbstractEventLoop, pair: Pair
) -> None:
    async def body() -> None:
        # Aborted between reservation and arrival: the bytes are drained and dropped.
        inp = _input("aborted", 48, max_tokens=50)
        res = await pair.decode.reserve(inp)
        assert res is not None
        sending = asyncio.ensure_future(pair.prefill.prefill(inp, res))
        await pair.decode.abort(inp.req_id)
        await sending
        await pair.wait_zero()
        # A reservation nobody fills is freed when its lease runs out.
        lease = await pair.decode.reserve(_input("lease", 64), lease_s=0.3)
        assert lease is not None
        assert (await pair.blocks_in_use())[1] == 4
        await pair.wait_zero(timeout=5)

    run(loop, body())


def test_requests_prefilled_in_one_step_travel_in_one_message(
    loop: asyncio.AbstractEventLoop, pair: Pair
) -> None:
    async def body() -> None:
        channel = pair.prefill.channels["decode-0"]
        assert isinstance(channel, KVChannel)  # the process-group backend counts its headers
        inputs = [_input(f"burst-{i}", 12 + i) for i in range(6)]
        reservations = await asyncio.gather(*(pair.decode.reserve(inp) for inp in inputs))
        # Queued together: they share the engine's first step (6 x ~15 tokens < 2048).
        posted_before = channel.num_posted
        streamed_before = pair.prefill.num_streamed_messages
        results = await asyncio.gather(
            *(pair.prefill.prefill(inp, res) for inp, res in zip(inputs, reservations, strict=True))
        )
        assert all(r.finish_reason is None for r in results), results
        seen: dict[str, list[TokenUpdate]] = {inp.req_id: [] for inp in inputs}
        deadline = loop.time() + 20
        while loop.time() < deadline and not all(u and u[-1].finish_reason for u in seen.values()):
            for u in (await pair.decode.next_tokens(0.2)).updates:
                if u.req_id in seen:
                    seen[u.req_id].append(u)
        for updates in seen.values():
            assert updates[-1].finish_reason is FinishReason.LENGTH
            assert updates[0].kv_wire_s > 0 and updates[0].kv_handoff_s >= 0
            if not pair.streamed:  # a streamed message's bytes leave before the step ends
                assert updates[0].kv_handoff_s >= updates[0].kv_wire_s
        assert channel.num_posted - posted_before < len(inputs)
        num_streamed = pair.prefill.num_streamed_messages - streamed_before
        assert num_streamed == (channel.num_posted - posted_before if pair.streamed else 0)
        await pair.wait_zero()

    run(loop, body())


def test_a_burst_of_short_prompts_streams_once_their_kv_adds_up(
    loop: asyncio.AbstractEventLoop, pair: Pair
) -> None:
    """The streaming threshold counts a pass's message, not each prompt: six prompts
    far below it that finish in one pass stream together; a lone one goes whole."""

    async def body() -> None:
        prefill = pair.prefill
        saved, prefill.stream_min_tokens = prefill.stream_min_tokens, 30
        try:
            lone = _input("lone", 20)
            before = prefill.num_streamed_messages
            [res] = await asyncio.gather(pair.decode.reserve(lone))
            assert (await prefill.prefill(lone, res)).finish_reason is None
            assert prefill.num_streamed_messages == before  # 20 tokens < 30: whole
            # 12-17 tokens each, 87 in all: queued together, they share a pass (any
            # three of them reach the threshold).
            inputs = [_input(f"short-{i}", 12 + i) for i in range(6)]
            reservations = await asyncio.gather(*(pair.decode.reserve(i) for i in inputs))
            results = await asyncio.gather(
                *(prefill.prefill(i, r) for i, r in zip(inputs, reservations, strict=True))
            )
            assert all(r.finish_reason is None for r in results), results
            assert prefill.num_streamed_messages > before
            want = {i.req_id for i in inputs} | {"lone"}
            finished: set[str] = set()
            deadline = loop.time() + 20
            while loop.time() < deadline and finished != want:
                for u in (await pair.decode.next_tokens(0.2)).updates:
                    if u.finish_reason is not None:
                        assert u.finish_reason is FinishReason.LENGTH, u
                        finished.add(u.req_id)
            assert finished == want
        finally:
            prefill.stream_min_tokens = saved
        await pair.wait_zero()

    run(loop, body())


def test_an_abort_while_the_kv_lands_keeps_its_blocks_until_the_receiver_lets_go(
    loop: asyncio.AbstractEventLoop, pair: Pair
) -> None:
    """Freed mid-import, a reservation's blocks could go to another request while the
    import still writes into them: the abort only marks it, and the receiving thread
    frees them once its bytes have landed (or broken off)."""

    async def body() -> None:
        decode = pair.decode
        inp = _input("landing", 40)
        res = await decode.reserve(inp)
        assert res is not None
        # What the receiving thread does when this request's header arrives.
        entry = HandoffEntry("landing", 40, len(res.block_ids), NO_TOKEN)
        held, problem = decode.book.claim(entry, res.epoch)
        assert held is not None, problem
        await decode.abort("landing")
        await asyncio.sleep(0.05)  # a few engine steps
        assert (await pair.blocks_in_use())[1] == len(res.block_ids)
        # The bytes landed: the book says the request was aborted meanwhile, and the
        # receiver gives the blocks back.
        assert not decode.book.complete("landing", lambda: None)
        decode.release("landing")
        await pair.wait_zero()

    run(loop, body())


def test_the_first_token_does_not_wait_for_its_hand_off_to_be_posted(
    loop: asyncio.AbstractEventLoop, pair: Pair
) -> None:
    """The prefill worker's reply (the request's first token, for the router to stream)
    leaves before the step's KV message is posted: a post held up on the engine thread
    does not hold the reply, and the KV still arrives once it goes."""
    if pair.streamed:
        pytest.skip("a streamed message is posted during the pass, before the first token")

    async def body() -> None:
        prefill = pair.prefill
        entered, release = threading.Event(), threading.Event()
        held: list[bool] = []
        post = prefill.post_message

        def held_post(
            channel: PairChannel, message: Message, kind: HeaderKind = HeaderKind.HANDOFF
        ) -> tuple[HandoffHeader, Any]:
            entered.set()
            held.append(release.wait(timeout=10))  # engine thread, until the reply is in
            return post(channel, message, kind)

        inp = _input("not-held", 40)
        res = await pair.decode.reserve(inp)
        assert res is not None
        prefill.post_message = held_post  # type: ignore[method-assign]
        try:
            # The post waits for `release`: a reply that waited for the post never comes.
            result = await asyncio.wait_for(prefill.prefill(inp, res), timeout=5)
            assert not held
            # The engine thread hands the reply over, then looks the post up: the held one
            # must stay in place until it did, however late a loaded machine runs it.
            took_it = await asyncio.get_running_loop().run_in_executor(None, entered.wait, 10)
            assert took_it, "the step's KV message was never posted"
        finally:
            release.set()
            del prefill.post_message
        assert result.finish_reason is None and result.first_token is not None, result
        assert result.transfer_bytes == 3 * prefill.block_bytes
        updates = await pair.updates_for("not-held")
        assert held == [True]
        assert updates[0].kv_wire_s > 0
        assert sum(len(u.new_token_ids) for u in updates) == 3
        await pair.wait_zero()

    run(loop, body())
