"""Independent pools under fire: scaling while streaming, and workers killed mid-traffic.

One service runs the module's scenario in order: 1P1D scales to 2P2D while requests
stream, and a burst spreads over both pairs; two hundred requests (mixed lengths, ~20 %
cancelled at random points, some with short deadlines) run while a prefill and a decode
worker are SIGKILLed (the decode one twice); the pools come back; then it scales back
to 1P1D while streaming. Every stream ends with exactly one terminal outcome, no block
stays in use, and greedy outputs equal the in-process engine's.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from engine.factory import EngineArgs
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from pdserve.v1 import admin_pb2 as admin_pb
from pdserve.v1 import generation_pb2 as pb
from router.admin_client import list_workers, scale_pool
from router.client import get_pool_stats, stream_generate
from tests.service import ServiceProcess

pytestmark = pytest.mark.e2e

PROMPTS = [f"Item {i}: name a colour and an animal." for i in range(6)] + [
    "Write one long sentence about rivers, mountains, forests and the sea " * (1 + i % 3)
    for i in range(4)
]
MAX_TOKENS = [3, 6, 10, 4, 8, 5, 7, 3, 9, 6]


@pytest.fixture(scope="module")
def service(
    tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path, ray_session: str
) -> Iterator[ServiceProcess]:
    svc = ServiceProcess(
        [
            "--ray-address",
            ray_session,
            "--enable-admin",
            "--prefill-kv-cache-gib",
            "0.05",
            "--decode-kv-cache-gib",
            "0.05",
            "--local-prefill-max-tokens",  # every prompt goes through a hand-off
            "0",
        ],
        tmp_path_factory.mktemp("svc-pools") / "service.log",
    )
    svc.wait_serving()
    yield svc
    assert svc.stop() == 0, svc.log_tail()


@pytest.fixture(scope="module")
def expected(smollm2_path: Path) -> dict[int, list[int]]:
    """Greedy tokens of each prompt from the in-process engine."""
    llm = LLM(EngineArgs(kv_cache_gib=0.05))
    outs = llm.generate(
        PROMPTS,
        [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS],
    )
    return {i: list(o.token_ids) for i, o in enumerate(outs)}


async def _one(address: str, i: int, timeout: float | None = None) -> tuple[str, list[int]]:
    """('final:<REASON>', tokens) or ('status:<CODE>', tokens); exactly one per call."""
    tokens: list[int] = []
    finals = 0
    reason = ""
    try:
        async for resp in stream_generate(
            address,
            prompt=PROMPTS[i],
            max_tokens=MAX_TOKENS[i],
            temperature=0.0,
            ignore_eos=True,
            timeout=timeout,
        ):
            assert finals == 0, "a message after the final one"
            tokens.extend(resp.token_ids)
            if resp.finish_reason:
                finals += 1
                reason = pb.FinishReason.Name(resp.finish_reason)
    except grpc.aio.AioRpcError as exc:
        if finals:
            # ERROR finals are followed by INTERNAL: still one terminal message.
            return f"final:{reason}", tokens
        return f"status:{exc.code().name}", tokens
    assert finals == 1, "stream ended without a final message"
    return f"final:{reason}", tokens


async def _wait_pools(address: str, prefill: int, decode: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        listing = await list_workers(address)
        live = [w for w in listing.workers if w.state == admin_pb.WORKER_STATE_LIVE]
        pools = [w.pool for w in live]
        # The pools are at size, and every live pair has its channel.
        paired = all(len(w.peers) == (decode if w.pool == "prefill" else prefill) for w in live)
        if pools.count("prefill") == prefill and pools.count("decode") == decode and paired:
            return
        await asyncio.sleep(0.5)
    raise AssertionError(f"pools not at {prefill}P{decode}D: {listing}")


async def _wait_no_blocks(address: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = await get_pool_stats(address)
        if all(w.num_blocks_in_use == 0 for w in stats.workers) and stats.num_in_flight == 0:
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"blocks still in use: {stats}")


async def _resize_while_streaming(
    address: str, expected: dict[int, list[int]], sizes: list[tuple[str, int]]
) -> None:
    """Resize pools one after the other while requests keep coming; every request that
    was sent meanwhile finishes at full length with the engine's tokens."""

    async def resize() -> None:
        for pool, size in sizes:
            await scale_pool(address, pool, size)

    sent: list[asyncio.Task[tuple[str, list[int]]]] = []
    action = asyncio.ensure_future(resize())
    while not action.done() or len(sent) < 4:
        sent.append(asyncio.ensure_future(_one(address, len(sent) % len(PROMPTS))))
        await asyncio.sleep(0.3)
    await action
    results = await asyncio.gather(*sent)
    for n, (outcome, tokens) in enumerate(results):
        assert outcome == "final:FINISH_REASON_LENGTH", (n, outcome)
        assert tokens == expected[n % len(PROMPTS)]
    final = dict(sizes)
    await _wait_pools(address, final["prefill"], final["decode"])
    await _wait_no_blocks(address)


def test_scale_up_while_streaming(service: ServiceProcess, expected: dict[int, list[int]]) -> None:
    asyncio.run(_resize_while_streaming(service.address, expected, [("prefill", 2), ("decode", 2)]))


def test_requests_spread_over_both_pairs(
    service: ServiceProcess, expected: dict[int, list[int]]
) -> None:
    async def scenario() -> tuple[list[tuple[str, list[int]]], set[tuple[int, int]]]:
        tasks = [asyncio.ensure_future(_one(service.address, i)) for i in range(len(PROMPTS))]
        busy: set[tuple[int, int]] = set()  # (pool, index) seen with running requests
        while not all(t.done() for t in tasks):
            stats = await get_pool_stats(service.address)
            busy |= {(w.pool, w.index) for w in stats.workers if w.num_running > 0}
            await asyncio.sleep(0.05)
        stats = await get_pool_stats(service.address)
        busy |= {
            (w.pool, w.index)
            for w in stats.workers
            if w.pool == pb.POOL_PREFILL and w.prefix_query_tokens > 0
        }
        return [await t for t in tasks], busy

    results, busy = asyncio.run(scenario())
    assert {(pb.POOL_PREFILL, 0), (pb.POOL_PREFILL, 1)} <= busy
    assert {(pb.POOL_DECODE, 0), (pb.POOL_DECODE, 1)} <= busy
    for i, (outcome, tokens) in enumerate(results):
        assert outcome == "final:FINISH_REASON_LENGTH"
        assert tokens == expected[i]


def test_chaos_kills_cancels_and_deadlines(
    service: ServiceProcess, expected: dict[int, list[int]]
) -> None:
    rng = random.Random(5)

    async def victim(pool: str) -> int:
        listing = await list_workers(service.address)
        live = [
            w for w in listing.workers if w.pool == pool and w.state == admin_pb.WORKER_STATE_LIVE
        ]
        return live[0].pid

    async def kill(pool: str, after_s: float) -> None:
        await asyncio.sleep(after_s)
        os.kill(await victim(pool), signal.SIGKILL)

    async def kill_twice(pool: str, after_s: float) -> None:
        """Kill a worker, wait for its replacement to serve, and kill that one too."""
        await asyncio.sleep(after_s)
        listing = await list_workers(service.address)
        first = next(w for w in listing.workers if w.pool == pool)
        os.kill(first.pid, signal.SIGKILL)
        while True:
            await asyncio.sleep(0.5)
            listing = await list_workers(service.address)
            again = [
                w
                for w in listing.workers
                if w.worker_id == first.worker_id
                and w.epoch != first.epoch
                and w.state == admin_pb.WORKER_STATE_LIVE
            ]
            if again:
                os.kill(again[0].pid, signal.SIGKILL)
                return

    async def request(n: int) -> tuple[int, str, list[int], str]:
        await asyncio.sleep(rng.uniform(0, 16))
        i = rng.randrange(len(PROMPTS))
        kind = rng.choices(["full", "cancel", "deadline"], [0.7, 0.2, 0.1])[0]
        if kind == "cancel":
            task = asyncio.ensure_future(_one(service.address, i))
            await asyncio.sleep(rng.uniform(0.0, 1.5))
            task.cancel()
            try:
                outcome, tokens = await task
            except asyncio.CancelledError:
                outcome, tokens = "cancelled", []
        else:
            timeout = rng.uniform(0.05, 0.5) if kind == "deadline" else 120
            outcome, tokens = await _one(service.address, i, timeout)
        return i, outcome, tokens, kind

    async def scenario() -> None:
        kills = [kill_twice("decode", 4), kill("prefill", 9)]
        results = await asyncio.gather(*(request(n) for n in range(200)), *kills)
        outcomes = [r for r in results if r is not None]
        completed = 0
        for i, outcome, tokens, kind in outcomes:
            allowed = {"final:FINISH_REASON_LENGTH", "final:FINISH_REASON_ERROR"}
            if kind == "cancel":
                allowed |= {"cancelled"}
            if kind == "deadline":
                allowed |= {"status:DEADLINE_EXCEEDED"}
            assert outcome in allowed, (kind, outcome)
            if outcome == "final:FINISH_REASON_LENGTH":
                completed += 1
                assert tokens == expected[i]
        assert completed >= 100, completed
        # The killed workers were replaced, paired and serve again.
        await _wait_pools(service.address, 2, 2)
        listing = await list_workers(service.address)
        assert listing.num_restarts == 3
        after = await asyncio.gather(*(_one(service.address, i) for i in range(len(PROMPTS))))
        for i, (outcome, tokens) in enumerate(after):
            assert outcome == "final:FINISH_REASON_LENGTH"
            assert tokens == expected[i]
        await _wait_no_blocks(service.address)

    try:
        asyncio.run(scenario())
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n--- service log ---\n{service.log_tail(8000)}") from exc


def test_scale_down_while_streaming(
    service: ServiceProcess, expected: dict[int, list[int]]
) -> None:
    asyncio.run(_resize_while_streaming(service.address, expected, [("decode", 1), ("prefill", 1)]))


def test_admin_is_refused_unless_enabled(tmp_path: Path) -> None:
    from router.admin import AdminServicer
    from router.grpc_server import GrpcServer
    from router.service import WarmingGenerator

    async def scenario() -> None:
        server = GrpcServer(
            WarmingGenerator(), port=0, admin=AdminServicer(lambda: None, enabled=False)
        )
        await server.start()
        try:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await list_workers(server.address)
            assert info.value.code() is grpc.StatusCode.PERMISSION_DENIED
            assert "--enable-admin" in (info.value.details() or "")
        finally:
            await server.stop(0)

    asyncio.run(scenario())
