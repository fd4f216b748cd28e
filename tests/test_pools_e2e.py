"""Independent pools under fire: scaling while streaming, and workers killed mid-traffic.

One service (starting at 1 prefill + 1 decode worker) serves the module; each test first
brings the pools to the size it starts from, so any test runs alone or in any order.
Scaling up to 2P2D and back down happens while requests stream; a burst spreads over
both pairs; two hundred requests (mixed lengths, ~20 % cancelled at random points, some
with short deadlines) run while a prefill and a decode worker are SIGKILLed (the decode
one twice) and the pools come back; seeded streams continue when their decode worker
is killed; a stream on the only decode worker goes on once that worker's replacement is
live; a drained decode worker hands its running generations to its peer with their KV.
Every stream ends with exactly one terminal outcome, no block stays in use, and greedy
and seeded outputs equal the in-process engine's.
"""

from __future__ import annotations

import asyncio
import functools
import os
import random
import signal
import time
from typing import Any

import grpc
import pytest

from bench.drain import drain_phases
from bench.harness import ServiceProcess
from bench.harness.metrics import scrape
from bench.harness.metrics import value as metric_value
from bench.harness.polling import wait_until_async
from bench.harness.pools import wait_pool_sizes
from bench.harness.streams import StreamResult, generate
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from pdserve.v1 import admin_pb2 as admin_pb
from pdserve.v1 import generation_pb2 as pb
from router.cli.admin_client import list_workers, migrate_requests, scale_pool
from router.cli.client import get_pool_stats
from tests.services import StartService, assert_pools_empty

pytestmark = pytest.mark.e2e

PROMPTS = [f"Item {i}: name a colour and an animal." for i in range(6)] + [
    "Write one long sentence about rivers, mountains, forests and the sea " * (1 + i % 3)
    for i in range(4)
]
MAX_TOKENS = [3, 6, 10, 4, 8, 5, 7, 3, 9, 6]


@pytest.fixture(scope="module")
def service(start_service: StartService, ray_session: str) -> ServiceProcess:
    return start_service(
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
        name="svc-pools",
    )


@pytest.fixture(scope="module")
def expected(reference_llm: LLM) -> dict[int, list[int]]:
    """Greedy tokens of each prompt from the in-process engine."""
    outs = reference_llm.generate(
        PROMPTS,
        [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS],
    )
    return {i: list(o.token_ids) for i, o in enumerate(outs)}


async def _one(address: str, i: int, timeout: float | None = None) -> StreamResult:
    """Prompt i, greedy; the result must have at most one final and nothing after it."""
    result = await generate(
        address,
        prompt=PROMPTS[i],
        max_tokens=MAX_TOKENS[i],
        temperature=0.0,
        ignore_eos=True,
        timeout=timeout,
    )
    assert result.num_finals <= 1 and result.num_after_final == 0, result
    # A status without a final is an ending too (DEADLINE_EXCEEDED); OK needs its final.
    assert result.final is not None or result.code != grpc.StatusCode.OK, result
    return result


async def _pools_at(address: str, prefill: int, decode: int) -> None:
    """Bring the pools to the given size (no-op when there), all paired, nothing in use."""
    await scale_pool(address, "prefill", prefill)
    await scale_pool(address, "decode", decode)
    await wait_pool_sizes(address, prefill, decode)
    await assert_pools_empty(address)


async def _resize_while_streaming(
    address: str, expected: dict[int, list[int]], sizes: list[tuple[str, int]]
) -> None:
    """Resize pools one after the other while requests keep coming; every request that
    was sent meanwhile finishes at full length with the engine's tokens."""

    async def resize() -> None:
        for pool, size in sizes:
            await scale_pool(address, pool, size)

    sent: list[asyncio.Task[StreamResult]] = []
    action = asyncio.ensure_future(resize())
    while not action.done() or len(sent) < 4:
        sent.append(asyncio.ensure_future(_one(address, len(sent) % len(PROMPTS))))
        await asyncio.sleep(0.3)
    await action
    results = await asyncio.gather(*sent)
    for n, result in enumerate(results):
        assert result.outcome == "final:FINISH_REASON_LENGTH", (n, result.outcome)
        assert result.tokens == expected[n % len(PROMPTS)]
    final = dict(sizes)
    await wait_pool_sizes(address, final["prefill"], final["decode"])
    await assert_pools_empty(address)


@pytest.mark.slow  # two worker starts while streaming, about 30 s: `make test-slow`
def test_scale_up_while_streaming(service: ServiceProcess, expected: dict[int, list[int]]) -> None:
    async def scenario() -> None:
        await _pools_at(service.address, 1, 1)
        await _resize_while_streaming(service.address, expected, [("prefill", 2), ("decode", 2)])

    asyncio.run(scenario())


def test_requests_spread_over_both_pairs(
    service: ServiceProcess, expected: dict[int, list[int]]
) -> None:
    async def scenario() -> tuple[list[StreamResult], set[tuple[int, int]]]:
        await _pools_at(service.address, 2, 2)
        before = await get_pool_stats(service.address)
        queried = {(w.pool, w.index): w.prefix_query_tokens for w in before.workers}
        tasks = [asyncio.ensure_future(_one(service.address, i)) for i in range(len(PROMPTS))]
        busy: set[tuple[int, int]] = set()  # (pool, index) seen with running requests
        while not all(t.done() for t in tasks):
            stats = await get_pool_stats(service.address)
            busy |= {(w.pool, w.index) for w in stats.workers if w.num_running > 0}
            await asyncio.sleep(0.05)
        stats = await get_pool_stats(service.address)
        # A prefill worker that looked prompts up in its cache since the burst began ran
        # some of them (its requests may start and end between two polls).
        busy |= {
            (w.pool, w.index)
            for w in stats.workers
            if w.pool == pb.POOL_PREFILL
            and w.prefix_query_tokens > queried.get((w.pool, w.index), 0)
        }
        return [await t for t in tasks], busy

    results, busy = asyncio.run(scenario())
    assert {(pb.POOL_PREFILL, 0), (pb.POOL_PREFILL, 1)} <= busy
    assert {(pb.POOL_DECODE, 0), (pb.POOL_DECODE, 1)} <= busy
    for i, result in enumerate(results):
        assert result.outcome == "final:FINISH_REASON_LENGTH"
        assert result.tokens == expected[i]


def test_seeded_streams_on_a_killed_decode_worker_end_with_the_undisturbed_text(
    service: ServiceProcess,
) -> None:
    """SIGKILL the decode worker while seeded streams with stop strings run on it: each
    continues on the other decode worker, and the client sees the text the same request
    gets from the undisturbed service."""
    seeded = [
        SamplingParams(max_tokens=40, temperature=0.8, top_k=40, seed=11 + i, ignore_eos=True)
        for i in range(4)
    ]
    prompts = PROMPTS[:4]

    def sampling(params: SamplingParams) -> dict[str, Any]:
        return {
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_k": params.top_k,
            "seed": params.seed,
            "ignore_eos": True,
        }

    async def scenario() -> tuple[list[StreamResult], list[StreamResult], list[str]]:
        await _pools_at(service.address, 2, 2)
        reference = await asyncio.gather(
            *(
                generate(service.address, prompt=p, **sampling(s))
                for p, s in zip(prompts, seeded, strict=True)
            )
        )
        # A stop string late in each text: the matcher has seen the tokens before the kill.
        stops = [r.text[-12:-6] for r in reference]
        before = scrape(service.metrics_port)[1]
        seen = [0] * len(prompts)
        streams = [
            asyncio.ensure_future(
                generate(
                    service.address,
                    prompt=p,
                    stop=[stop],
                    on_tokens=functools.partial(seen.__setitem__, i),
                    **sampling(params),
                )
            )
            for i, (p, params, stop) in enumerate(zip(prompts, seeded, stops, strict=True))
        ]
        await wait_until_async(
            lambda: all(n >= 3 or t.done() for n, t in zip(seen, streams, strict=True)),
            60,
            what="every stream under way",
        )
        # The decode worker with the most streams on it dies.
        stats = await get_pool_stats(service.address)
        busiest = max(
            (w for w in stats.workers if w.pool == pb.POOL_DECODE), key=lambda w: w.num_running
        )
        listing = await list_workers(service.address)
        victim = next(w for w in listing.workers if w.worker_id == f"decode-{busiest.index}")
        os.kill(victim.pid, signal.SIGKILL)
        results = await asyncio.gather(*streams)
        after = scrape(service.metrics_port)[1]
        labels = {"pool": "decode", "reason": "worker_died"}
        moved = metric_value(after, "pdserve_request_migrations_total", **labels)
        moved -= metric_value(before, "pdserve_request_migrations_total", **labels)
        assert moved >= 1, "no stream was on the killed worker any more"
        await assert_pools_empty(service.address)  # its replacement may still be starting
        return results, reference, stops

    results, reference, stops = asyncio.run(scenario())
    for result, ref, stop in zip(results, reference, stops, strict=True):
        assert ref.outcome == "final:FINISH_REASON_LENGTH", ref.outcome
        assert result.outcome == "final:FINISH_REASON_STOP", (result.outcome, result.details)
        assert result.text == ref.text[: ref.text.index(stop)]
        assert result.final is not None
        assert result.final.usage.completion_tokens == len(result.tokens)


@pytest.mark.slow  # a decode worker's replacement, about 20 s: `make test-slow`
def test_a_stream_on_the_only_decode_worker_resumes_when_its_replacement_is_live(
    service: ServiceProcess,
) -> None:
    """SIGKILL the only decode worker mid-stream on an otherwise quiet service: the stream
    waits for the replacement and goes on as soon as it is live, no other request needed."""

    async def scenario() -> tuple[StreamResult, float, list[tuple[float, int]]]:
        await _pools_at(service.address, 1, 1)
        arrivals: list[tuple[float, int]] = []
        stream = asyncio.ensure_future(
            generate(
                service.address,
                prompt=PROMPTS[6],
                max_tokens=120,
                temperature=0.0,
                ignore_eos=True,
                on_tokens=lambda n: arrivals.append((time.monotonic(), n)),
            )
        )
        await wait_until_async(lambda: len(arrivals) >= 5, 60, what="the stream under way")
        victim = (await list_workers(service.address)).workers
        decode = next(w for w in victim if w.pool == "decode")
        os.kill(decode.pid, signal.SIGKILL)

        async def replaced() -> bool:
            listing = await list_workers(service.address)
            return any(
                w.worker_id == decode.worker_id
                and w.epoch != decode.epoch
                and w.state == admin_pb.WORKER_STATE_LIVE
                for w in listing.workers
            )

        await wait_until_async(replaced, 120, interval=0.1, what="the replacement live")
        live_at = time.monotonic()
        result = await asyncio.wait_for(stream, 60)
        await assert_pools_empty(service.address)
        return result, live_at, arrivals

    result, live_at, arrivals = asyncio.run(scenario())
    assert result.outcome == "final:FINISH_REASON_LENGTH", (result.outcome, result.details)
    assert len(result.tokens) == 120
    resumed_at = next(t for t, _ in arrivals if t >= live_at - 0.1)
    assert resumed_at - live_at < 2.0, f"tokens resumed {resumed_at - live_at:.1f} s after"


@pytest.mark.slow
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
                result = await task
                outcome, tokens = result.outcome, result.tokens
            except asyncio.CancelledError:
                outcome, tokens = "cancelled", []
        else:
            timeout = rng.uniform(0.05, 0.5) if kind == "deadline" else 120
            result = await _one(service.address, i, timeout)
            outcome, tokens = result.outcome, result.tokens
        return i, outcome, tokens, kind

    async def scenario() -> None:
        await _pools_at(service.address, 2, 2)
        restarts_before = (await list_workers(service.address)).num_restarts
        kills = [kill_twice("decode", 4), kill("prefill", 9)]
        results = await asyncio.gather(*(request(n) for n in range(200)), *kills)
        outcomes = [r for r in results if r is not None]
        completed = 0
        for i, outcome, tokens, kind in outcomes:
            # A request whose worker dies continues on another (from the tokens it had
            # streamed): every uncancelled request completes, with the undisturbed text.
            allowed = {"final:FINISH_REASON_LENGTH"}
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
        listing = await wait_pool_sizes(service.address, 2, 2)
        assert listing.num_restarts - restarts_before == 3
        after = await asyncio.gather(*(_one(service.address, i) for i in range(len(PROMPTS))))
        for i, result in enumerate(after):
            assert result.outcome == "final:FINISH_REASON_LENGTH"
            assert result.tokens == expected[i]
        await assert_pools_empty(service.address)

    try:
        asyncio.run(scenario())
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n--- service log ---\n{service.log_tail(8000)}") from exc


async def _greedy_streams_under_way_on_decode_1(
    address: str, prompts: list[str], max_tokens: int
) -> tuple[list[asyncio.Task[StreamResult]], list[StreamResult]]:
    """Each prompt run once undisturbed (the reference), then all streamed again at once
    until some run on decode-1 and every stream has its first tokens."""
    params: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    reference = await asyncio.gather(*(generate(address, prompt=p, **params) for p in prompts))
    seen = [0] * len(prompts)
    streams = [
        asyncio.ensure_future(
            generate(address, prompt=p, on_tokens=functools.partial(seen.__setitem__, i), **params)
        )
        for i, p in enumerate(prompts)
    ]

    async def under_way_on_decode_1() -> bool:
        stats = await get_pool_stats(address)
        running = {w.index: w.num_running for w in stats.workers if w.pool == pb.POOL_DECODE}
        return min(seen) >= 2 and running.get(1, 0) > 0

    await wait_until_async(under_way_on_decode_1, 60, what="streams running on decode-1")
    return streams, list(reference)


def _same_texts(results: list[StreamResult], reference: list[StreamResult]) -> None:
    for result, ref in zip(results, reference, strict=True):
        assert ref.outcome == "final:FINISH_REASON_LENGTH", ref.outcome
        assert result.outcome == "final:FINISH_REASON_LENGTH", (result.outcome, result.details)
        assert result.tokens == ref.tokens


def test_migrate_requests_rebalances_with_the_kv_and_the_worker_stays(
    service: ServiceProcess,
) -> None:
    """`MigrateRequests` moves running generations off decode-1 to decode-0 with their KV
    while decode-1 stays live; each text is the one the undisturbed service gives."""
    prompts = [f"Note {i}: the orchard gate was painted green." for i in range(4)]

    async def scenario() -> tuple[list[StreamResult], list[StreamResult]]:
        await _pools_at(service.address, 2, 2)
        streams, reference = await _greedy_streams_under_way_on_decode_1(
            service.address, prompts, 40
        )
        reply = await migrate_requests(service.address, "decode-1")
        assert reply.moved_with_kv >= 1 and reply.moved_by_recompute == 0, reply
        states = {w.worker_id: w.state for w in (await list_workers(service.address)).workers}
        assert states["decode-1"] == admin_pb.WORKER_STATE_LIVE
        results = await asyncio.gather(*streams)
        await assert_pools_empty(service.address)
        return results, reference

    _same_texts(*asyncio.run(scenario()))


def test_a_drained_decode_worker_hands_its_running_generations_over(
    service: ServiceProcess,
) -> None:
    """`pdserve scale --decode 1` with long generations running on decode-1: they move to
    decode-0 with their KV (no prompt runs again), the scale returns while they still
    run, and each text is the one the undisturbed service gives."""
    prompts = [f"Story {i}: the lighthouse keeper counted the ships." for i in range(6)]

    async def scenario() -> tuple[list[StreamResult], list[StreamResult], float]:
        await _pools_at(service.address, 2, 2)
        before = scrape(service.metrics_port)[1]
        streams, reference = await _greedy_streams_under_way_on_decode_1(
            service.address, prompts, 48
        )
        started = time.monotonic()
        await scale_pool(service.address, "decode", 1)
        scale_s = time.monotonic() - started
        still_running = sum(not s.done() for s in streams)
        results = await asyncio.gather(*streams)
        after = scrape(service.metrics_port)[1]

        def moved(reason: str) -> float:
            labels = {"pool": "decode", "reason": reason}
            return metric_value(after, "pdserve_request_migrations_total", **labels) - metric_value(
                before, "pdserve_request_migrations_total", **labels
            )

        assert moved("drained_kv") >= 1 and moved("drained") == 0, service.log_tail(3000)
        assert still_running > 0, "the scale-down waited for the generations to end"
        await assert_pools_empty(service.address)
        return results, reference, scale_s

    results, reference, scale_s = asyncio.run(scenario())
    assert scale_s < 10, f"the drain took {scale_s:.1f} s"
    _same_texts(results, reference)
    # The router's account of it is in the log, in the form `bench.drain` reads.
    phases = drain_phases(service.log_path.read_text(errors="replace"))
    assert {"paused_ms", "moves_s", "close_peer_channels_s", "stop_worker_s"} <= set(phases)


def test_scale_down_while_streaming(
    service: ServiceProcess, expected: dict[int, list[int]]
) -> None:
    async def scenario() -> None:
        # The decode pool shrank under long generations in the test before (it leaves it
        # at 2P1D): the prefill pool shrinks here.
        await _pools_at(service.address, 2, 1)
        await _resize_while_streaming(service.address, expected, [("decode", 1), ("prefill", 1)])

    asyncio.run(scenario())


def test_admin_is_refused_unless_enabled() -> None:
    from router.edge.admin import AdminServicer
    from router.edge.grpc_server import GrpcServer
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
