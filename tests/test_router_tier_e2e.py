"""End to end: a router tier (`pdserve serve --router-processes 2`) in front of one
prefill and one decode worker on the embedded model: both processes take calls on the
one port, every stream gives the colocated engine's text, and nothing is left held."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import grpc
import pytest

from bench.harness import ServiceProcess
from bench.harness.metrics import scrape
from bench.harness.metrics import value as metric_value
from bench.harness.polling import wait_until_async
from bench.harness.ports import free_port_run
from bench.harness.streams import StreamResult, generate
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from pdserve.v1 import admin_pb2 as admin_pb
from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import generation_pb2_grpc as pb_grpc
from router.cli.admin_client import drain_worker, list_workers, migrate_requests, scale_pool
from router.cli.client import build_request, resumable_generate, stream_generate
from tests.services import StartService, assert_pools_empty

pytestmark = pytest.mark.e2e

GRACE_S = 10  # a killed router process's requests are kept this long for a resume
LATE_RESUME_S = 6.5  # past the decode worker's deeming it gone (5 s without a poll)
NUM_STREAMS = 32
NUM_CONNECTIONS = 8
PROMPTS = [f"Question {i}: what comes after {i}?" for i in range(NUM_STREAMS)]
MAX_TOKENS = [6 + i % 7 for i in range(NUM_STREAMS)]


@pytest.fixture(scope="module")
def tier(start_service: StartService, ray_session: str) -> ServiceProcess:
    return start_service(
        [
            "--ray-address",
            ray_session,
            "--router-processes",
            "2",
            "--metrics-port",
            str(free_port_run(2)),
            "--prefill-kv-cache-gib",
            "0.25",
            "--decode-kv-cache-gib",
            "0.25",
            "--enable-admin",
            # Requests a killed router process leaves and nobody resumes are freed soon.
            "--resume-grace-s",
            str(GRACE_S),
        ],
        name="tier",
    )


def channel(address: str) -> grpc.aio.Channel:
    """A channel with a TCP connection of its own (channels to one target share one
    unless told not to): the kernel hands each connection to one of the tier's processes."""
    return grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


def _finished_per_process(tier: ServiceProcess) -> list[float]:
    """Each router process's count of calls that ended at their token budget."""
    return [
        metric_value(
            scrape(tier.metrics_port + i)[1], "pdserve_requests_total", finish_reason="length"
        )
        for i in range(2)
    ]


async def _process_of(tier: ServiceProcess, chan: grpc.aio.Channel) -> int:
    """Which router process `chan`'s connection reached: the one that counts a call on it."""
    before = _finished_per_process(tier)
    request = build_request(prompt="Which process?", max_tokens=1, ignore_eos=True)
    async for _ in pb_grpc.GenerationServiceStub(chan).Generate(request):
        pass

    def counted_by() -> list[int]:
        after = _finished_per_process(tier)
        return [i for i in range(2) if after[i] > before[i]]

    (process,) = await wait_until_async(counted_by, timeout=10, interval=0.05)
    return process


async def channels_on_each_process(
    tier: ServiceProcess, per_process: int = NUM_CONNECTIONS // 2
) -> list[grpc.aio.Channel]:
    """`per_process` connections to each router process, alternating. The kernel deals
    each new connection to one process or the other, at random: each is asked which
    until both have enough, so a test of both processes never finds all its streams on
    one."""
    on: list[list[grpc.aio.Channel]] = [[], []]
    for _ in range(per_process * 10):
        if min(len(chans) for chans in on) >= per_process:
            break
        chan = channel(tier.address)
        process = await _process_of(tier, chan)
        if len(on[process]) < per_process:
            on[process].append(chan)
        else:
            await chan.close()
    assert min(len(chans) for chans in on) >= per_process, "the kernel dealt to one process"
    return [chan for pair in zip(*on, strict=True) for chan in pair]


async def _streams_disturbed(
    tier: ServiceProcess,
    prompts: list[str],
    max_tokens: int,
    disturb: Callable[[], Awaitable[None]],
) -> list[list[int]]:
    """Greedy streams of `prompts` over connections to both processes; once each has 3
    tokens, `disturb()`; then each stream's tokens."""
    progress = [0] * len(prompts)

    async def one(stub: pb_grpc.GenerationServiceStub, i: int) -> list[int]:
        tokens: list[int] = []
        request = build_request(
            prompt=prompts[i], max_tokens=max_tokens, temperature=0.0, ignore_eos=True
        )
        async for response in stub.Generate(request):
            tokens.extend(response.token_ids)
            progress[i] = len(tokens)
        return tokens

    chans = await channels_on_each_process(tier)
    try:
        stubs = [pb_grpc.GenerationServiceStub(c) for c in chans]
        streams = [
            asyncio.ensure_future(one(stubs[i % len(stubs)], i)) for i in range(len(prompts))
        ]
        await wait_until_async(lambda: min(progress) >= 3, timeout=120)
        await disturb()
        return await asyncio.wait_for(asyncio.gather(*streams), 240)
    finally:
        for c in chans:
            await c.close()


async def _stream(stub: pb_grpc.GenerationServiceStub, prompt: str, n: int) -> list[int]:
    tokens: list[int] = []
    finals = 0
    request = build_request(prompt=prompt, max_tokens=n, temperature=0.0, ignore_eos=True)
    async for response in stub.Generate(request):
        tokens.extend(response.token_ids)
        if response.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            finals += 1
            assert response.finish_reason == pb.FINISH_REASON_LENGTH
    assert finals == 1
    return tokens


def test_both_router_processes_serve_streams_with_the_colocated_engines_tokens(
    tier: ServiceProcess, reference_llm: LLM
) -> None:
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS]

    async def run() -> tuple[list[list[int]], list[float]]:
        chans = await channels_on_each_process(tier)
        before = _finished_per_process(tier)
        try:
            stubs = [pb_grpc.GenerationServiceStub(c) for c in chans]
            served = await asyncio.gather(
                *(
                    _stream(stubs[i % NUM_CONNECTIONS], PROMPTS[i], MAX_TOKENS[i])
                    for i in range(NUM_STREAMS)
                )
            )
            return served, before
        finally:
            for c in chans:
                await c.close()

    served, before = asyncio.run(run())
    reference = reference_llm.generate(PROMPTS, params)
    for i, tokens in enumerate(served):
        assert tokens == list(reference[i].token_ids), f"stream {i} differs from colocated"
    # Each process counted its own calls (half of them: the connections alternate) on
    # its own /metrics.
    per_process = _since(before, _finished_per_process(tier))
    assert per_process == [NUM_STREAMS // 2] * 2, per_process
    # Nothing held on either worker, and the tier's shared admission is back to zero.
    asyncio.run(assert_pools_empty(tier.address, pools={pb.POOL_PREFILL, pb.POOL_DECODE}))


def _child_pids(tier: ServiceProcess) -> list[int]:
    """Every pid router process 1 ran as, in order, from the service's log."""
    return [
        int(pid)
        for pid in re.findall(r"router process 1 started \(pid (\d+)\)", tier.log_tail(10**7))
    ]


@pytest.mark.slow
def test_a_killed_router_process_is_restarted_and_its_streams_resume_elsewhere(
    tier: ServiceProcess, reference_llm: LLM
) -> None:
    """SIGKILL router process 1 with streams on both: the owner starts it again within
    5 s, the owner's streams go on untouched, a new call is taken at once, and each
    broken stream, resumed with its request id and token count at once (the decode
    worker hands its request over at a step boundary) or seconds later (from the
    record it kept of the gone process's request), ends with exactly the tokens of an
    undisturbed run; the requests nobody resumes are freed after the grace."""
    num, max_tokens = 12, 40
    prompts = [f"Tell me about the number {i}." for i in range(num)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    reference = reference_llm.generate(prompts, params)
    late_prompts = [f"Late resume {i}:" for i in range(2)]
    # Long enough to be still decoding when the decode worker deems the killed process
    # gone (LOST_AFTER_S without a poll): a request that ended before that is not
    # resumable (docs/architecture.md, Router tier).
    late_max_tokens = 200
    late_params = replace(params, max_tokens=late_max_tokens)
    late_reference = reference_llm.generate(late_prompts, late_params)
    (victim,) = _child_pids(tier)[-1:]
    resumed: list[int] = []
    late_resumed: list[int] = []
    progress = [0] * num

    async def one(i: int) -> list[int]:
        tokens: list[int] = []
        async for response in resumable_generate(
            tier.address,
            prompt=prompts[i],
            request_id=f"tier-kill-{i}",
            on_resume=lambda received, exc: resumed.append(received),
            max_tokens=max_tokens,
            temperature=0.0,
            ignore_eos=True,
        ):
            tokens.extend(response.token_ids)
            progress[i] = len(tokens)
        return tokens

    async def resume_late(i: int, task: asyncio.Future[Any], killed_at: float) -> None:
        """A late stream, resumed on its own as soon as it broke (not after the others)."""
        first = await task
        if first.code == grpc.StatusCode.OK:
            assert first.tokens == list(late_reference[i].token_ids)
            return
        assert first.code == grpc.StatusCode.UNAVAILABLE, first
        await asyncio.sleep(max(0.0, killed_at + LATE_RESUME_S - time.monotonic()))
        rest = await generate(
            tier.address,
            prompt=late_prompts[i],
            request_id=f"tier-late-{i}",
            resume_from_tokens=len(first.tokens),
            max_tokens=late_max_tokens,
            temperature=0.0,
            ignore_eos=True,
        )
        assert rest.code == grpc.StatusCode.OK, rest
        assert first.tokens + rest.tokens == list(late_reference[i].token_ids)
        late_resumed.append(i)

    async def run() -> tuple[list[list[int]], list[int], float]:
        streams = [asyncio.ensure_future(one(i)) for i in range(num)]
        kw: dict[str, Any] = dict(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        # Streams resumed seconds after they break, and streams never resumed (their
        # requests are the decode worker's to abort once the grace is over).
        late_kw = kw | {"max_tokens": late_max_tokens}
        late = [
            asyncio.ensure_future(
                generate(tier.address, prompt=p, request_id=f"tier-late-{i}", **late_kw)
            )
            for i, p in enumerate(late_prompts)
        ]
        never = [
            asyncio.ensure_future(generate(tier.address, prompt=f"Never resumed {i}", **kw))
            for i in range(2)
        ]
        await wait_until_async(lambda: min(progress) >= 4, timeout=120)
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        restart = asyncio.ensure_future(asyncio.to_thread(_wait_for_restart, tier, victim, 5.0))
        late_resumes = [
            asyncio.ensure_future(resume_late(i, task, killed_at)) for i, task in enumerate(late)
        ]
        # A survivor takes a new call at once.
        fresh = await _collect_tokens(tier.address, "A new call after the kill.", 4)
        for result in await asyncio.gather(*never):
            assert result.code in (grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE), result
        await asyncio.gather(*late_resumes)
        return await asyncio.gather(*streams), fresh, await restart - killed_at

    served, fresh, restart_s = asyncio.run(run())
    assert len(fresh) == 4
    assert restart_s <= 5.0, f"router process 1 started again after {restart_s:.1f} s"
    assert resumed, "no stream was on the killed process"
    assert len(resumed) < num, "every stream broke: the owner's should have gone on"
    for i, tokens in enumerate(served):
        assert tokens == list(reference[i].token_ids), f"stream {i} differs after resuming"
    asyncio.run(
        assert_pools_empty(tier.address, timeout=30, pools={pb.POOL_PREFILL, pb.POOL_DECODE})
    )


async def _collect_tokens(address: str, prompt: str, n: int) -> list[int]:
    tokens: list[int] = []
    async for response in resumable_generate(
        address, prompt=prompt, max_tokens=n, temperature=0.0, ignore_eos=True
    ):
        tokens.extend(response.token_ids)
    return tokens


def _wait_for_restart(tier: ServiceProcess, old_pid: int, timeout: float) -> float:
    """When (time.monotonic()) the log first names a new pid for router process 1."""
    deadline = time.monotonic() + timeout + 5
    while time.monotonic() < deadline:
        if _child_pids(tier)[-1] != old_pid:
            return time.monotonic()
        time.sleep(0.05)
    raise AssertionError(f"router process 1 not started again:\n{tier.log_tail()}")


def test_admin_calls_are_answered_by_the_owner_on_whichever_process_they_land(
    tier: ServiceProcess,
) -> None:
    """Sixteen connections (each to one process or the other, as the kernel deals them):
    every ListWorkers is the owner's answer, the same fleet."""

    async def run() -> list[list[tuple[str, int]]]:
        replies = await asyncio.gather(*(list_workers(tier.address) for _ in range(16)))
        return [sorted((w.worker_id, w.state) for w in r.workers) for r in replies]

    listings = asyncio.run(run())
    live = admin_pb.WORKER_STATE_LIVE
    assert all(listing == [("decode-0", live), ("prefill-0", live)] for listing in listings)


@pytest.mark.slow
def test_a_resumable_stream_broken_on_the_client_side_goes_on_where_it_was(
    tier: ServiceProcess, reference_llm: LLM
) -> None:
    """The client's side of a resumable stream goes away after a few tokens (its router
    process lives on): the request is kept, and the next call with its id and token
    count gets the rest, the same tokens as an undisturbed run."""
    prompt, max_tokens = "Name three rivers.", 24
    reference = reference_llm.generate(
        [prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    )[0]
    kw: dict[str, Any] = dict(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def run() -> tuple[list[int], StreamResult]:
        first: list[int] = []
        async for response in stream_generate(
            tier.address, prompt=prompt, request_id="client-break", resume_from_tokens=0, **kw
        ):
            first.extend(response.token_ids)
            if len(first) >= 5:
                break  # cancels the call, as a broken connection does
        await asyncio.sleep(0.5)
        rest = await generate(
            tier.address,
            prompt=prompt,
            request_id="client-break",
            resume_from_tokens=len(first),
            **kw,
        )
        return first, rest

    first, rest = asyncio.run(run())
    assert rest.code == grpc.StatusCode.OK, rest
    assert rest.final is not None and rest.final.usage.completion_tokens == max_tokens
    assert first + rest.tokens == list(reference.token_ids)


@pytest.mark.slow
def test_streams_on_both_processes_move_on_when_their_decode_worker_dies(
    tier: ServiceProcess, reference_llm: LLM
) -> None:
    """SIGKILL the only decode worker with streams on both router processes: each
    process learns it is lost (its own calls, or the owner's next membership), the owner
    starts the replacement, every process follows it, and every stream ends with the
    tokens of an undisturbed run."""
    num, max_tokens = 8, 32
    prompts = [f"Describe the colour number {i}." for i in range(num)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    reference = reference_llm.generate(prompts, params)

    async def kill_decode() -> None:
        workers = await list_workers(tier.address)
        (decode,) = [w for w in workers.workers if w.pool == "decode"]
        os.kill(decode.pid, signal.SIGKILL)

    served = asyncio.run(_streams_disturbed(tier, prompts, max_tokens, kill_decode))
    for i, tokens in enumerate(served):
        assert tokens == list(reference[i].token_ids), f"stream {i} differs after migrating"
    # Both processes had streams to move.
    log = tier.log_tail(10**7)
    assert "[router 1]" in log and "migrates off decode-0" in log
    asyncio.run(
        assert_pools_empty(tier.address, timeout=30, pools={pb.POOL_PREFILL, pb.POOL_DECODE})
    )


async def _live_decode(address: str) -> list[admin_pb.WorkerDescription]:
    workers = (await list_workers(address)).workers
    return [w for w in workers if w.pool == "decode" and w.state == admin_pb.WORKER_STATE_LIVE]


async def _streams_moved(
    tier: ServiceProcess, prompts: list[str], move: Callable[[str], Awaitable[None]]
) -> list[list[int]]:
    """Long greedy streams over connections to both processes, all on the one decode
    worker there is; once each has 3 tokens a second decode worker
    starts, then `move(the first one's id)`; once each stream has 8 tokens more, the
    calls end (the client cancels): each stream's tokens so far."""
    address = tier.address
    await scale_pool(address, "decode", 1)
    (first,) = await _live_decode(address)
    served: list[list[int]] = [[] for _ in prompts]

    async def one(stub: pb_grpc.GenerationServiceStub, i: int) -> None:
        request = build_request(
            prompt=prompts[i], max_tokens=2000, temperature=0.0, ignore_eos=True
        )
        async for response in stub.Generate(request):
            served[i].extend(response.token_ids)

    def each_has(counts: list[int]) -> bool:
        return all(len(tokens) >= n for tokens, n in zip(served, counts, strict=True))

    chans = await channels_on_each_process(tier)
    stubs = [pb_grpc.GenerationServiceStub(c) for c in chans]
    streams = [asyncio.ensure_future(one(stubs[i % len(stubs)], i)) for i in range(len(prompts))]
    try:
        await wait_until_async(lambda: each_has([3] * len(prompts)), timeout=120)
        await scale_pool(address, "decode", 2)
        await asyncio.sleep(1.0)  # the other process's view has the new worker
        await move(first.worker_id)
        at_move = [len(tokens) + 8 for tokens in served]
        await wait_until_async(lambda: each_has(at_move), timeout=240)
        for stream in streams:
            assert not stream.done(), stream  # no stream failed or ended early
    finally:
        for stream in streams:
            stream.cancel()
        for c in chans:
            await c.close()
    return [list(tokens) for tokens in served]


def _assert_greedy_prefixes(
    reference_llm: LLM, prompts: list[str], served: list[list[int]]
) -> None:
    """Each stream's tokens are the start of an undisturbed greedy run of its prompt."""
    longest = max(len(tokens) for tokens in served)
    params = SamplingParams(max_tokens=longest, temperature=0.0, ignore_eos=True)
    reference = reference_llm.generate(prompts, params)
    for i, tokens in enumerate(served):
        assert tokens == list(reference[i].token_ids[: len(tokens)]), f"stream {i} differs"


def _since(before: list[float], after: list[float]) -> list[float]:
    return [a - b for a, b in zip(after, before, strict=True)]


def _migrations(tier: ServiceProcess, reason: str) -> list[float]:
    """Each router process's count of requests moved off decode workers for `reason`."""
    return [
        metric_value(
            scrape(tier.metrics_port + i)[1],
            "pdserve_request_migrations_total",
            pool="decode",
            reason=reason,
        )
        for i in range(2)
    ]


@pytest.mark.slow  # grows the decode pool and drains it: about a minute
def test_a_drained_decode_worker_moves_every_processs_requests_with_their_kv(
    tier: ServiceProcess, reference_llm: LLM
) -> None:
    """Streams through both router processes on one decode worker, a second one started,
    then the first drained: each process moves its own requests off it with their KV
    (its migrations metric counts them as `drained_kv`, none by recompute), and every
    stream goes on with the tokens of an undisturbed run."""
    prompts = [f"Tell me about the number {i}." for i in range(8)]

    async def drain(worker_id: str) -> None:
        await drain_worker(tier.address, worker_id)

    kv_before, recomputed_before = _migrations(tier, "drained_kv"), _migrations(tier, "drained")
    served = asyncio.run(_streams_moved(tier, prompts, drain))
    _assert_greedy_prefixes(reference_llm, prompts, served)
    # Half the streams on each process (the connections alternate), each moved by it.
    with_kv = _since(kv_before, _migrations(tier, "drained_kv"))
    recomputed = _since(recomputed_before, _migrations(tier, "drained"))
    assert (with_kv, recomputed) == ([len(prompts) // 2] * 2, [0, 0]), (with_kv, recomputed)
    asyncio.run(
        assert_pools_empty(tier.address, timeout=30, pools={pb.POOL_PREFILL, pb.POOL_DECODE})
    )


@pytest.mark.slow  # grows the decode pool and moves every request: about a minute
def test_migrate_requests_moves_every_processs_requests_off_the_worker(
    tier: ServiceProcess, reference_llm: LLM
) -> None:
    """MigrateRequests on a decode worker with streams of both router processes on it,
    wherever the call lands: the owner has each process move its own with their KV, the
    reply counts them all (none left behind, none by recompute), and every stream goes
    on with the tokens of an undisturbed run."""
    prompts = [f"Write about the letter number {i}." for i in range(8)]
    replies: list[admin_pb.MigrateRequestsResponse] = []

    async def migrate(worker_id: str) -> None:
        replies.append(await migrate_requests(tier.address, worker_id))

    before = _migrations(tier, "rebalanced_kv")
    served = asyncio.run(_streams_moved(tier, prompts, migrate))
    _assert_greedy_prefixes(reference_llm, prompts, served)
    (reply,) = replies
    assert reply.num_candidates == len(prompts) and reply.moved_by_recompute == 0, reply
    assert reply.moved_with_kv == len(prompts), reply
    moved = _since(before, _migrations(tier, "rebalanced_kv"))
    assert moved == [len(prompts) // 2] * 2, moved  # each process moved its own
    asyncio.run(
        assert_pools_empty(tier.address, timeout=30, pools={pb.POOL_PREFILL, pb.POOL_DECODE})
    )
