"""The soak's phase with the only decode worker killed, on a quiet service.

The decode pool shrinks to one worker; a few streams run undisturbed on it (the
reference), then again until each has some tokens, when that worker's process is
SIGKILLed. With no other decode worker and no other traffic, the streams can only go on
once the replacement is live, and nothing but the replacement going live may wake them
(a request that waited for other traffic to arrive would stall here). Each stream must
complete with the reference's token count and text, and resume within `--resume-within-s`
of the replacement going live. The pool then grows back.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench.harness.polling import wait_until_async
from bench.harness.pools import live_workers, wait_pool_sizes
from bench.harness.streams import StreamResult, generate
from pdserve.v1 import admin_pb2 as admin_pb
from router.cli.admin_client import scale_pool

MIN_TOKENS_BEFORE_KILL = 8  # each stream's, so that every one is mid-way when it dies
COMPLETED = "final:FINISH_REASON_LENGTH"  # every request sets ignore_eos
# After the replacement is live, the streams get this long to end: a stream that waits
# for traffic that never comes is reported, and cancelled, not waited for.
END_WITHIN_S = 120.0


@dataclass
class TimedStream:
    """One stream's result and when each of its batches of tokens arrived."""

    arrivals: list[tuple[float, int]]  # (time.monotonic(), tokens so far)
    result: StreamResult | None = None

    @property
    def num_tokens(self) -> int:
        return self.arrivals[-1][1] if self.arrivals else 0


def resumed_at(arrivals: list[tuple[float, int]], killed_at: float) -> float | None:
    """When tokens came again after the kill: the arrival that ends the longest gap from
    the last arrival before `killed_at` on. Tokens sent just before the kill may still
    arrive after it; the stall is the gap until the replacement's first tokens. None
    when no token came after the kill."""
    before = [t for t, _ in arrivals if t < killed_at]
    after = [t for t, _ in arrivals if t >= killed_at]
    if not after:
        return None
    times = before[-1:] + after
    if len(times) == 1:
        return times[0]
    gaps = [(later - earlier, later) for earlier, later in zip(times, times[1:], strict=False)]
    return max(gaps)[1]


def check(
    reference: list[StreamResult],
    streams: list[TimedStream],
    resumed_after_live_s: list[float | None],
    resume_within_s: float,
) -> list[str]:
    """What the phase got wrong; empty when it passed."""
    wrong = []
    for i, (ref, stream, resumed) in enumerate(
        zip(reference, streams, resumed_after_live_s, strict=True)
    ):
        result = stream.result
        if result is None or result.outcome != COMPLETED:
            outcome = (
                f"no final message within {END_WITHIN_S:g} s of the replacement going live"
                if result is None
                else f"{result.outcome} {result.details}"
            )
            wrong.append(f"stream {i} did not complete: {outcome}")
            continue
        if len(result.tokens) != len(ref.tokens):
            wrong.append(f"stream {i}: {len(result.tokens)} tokens, undisturbed {len(ref.tokens)}")
        elif result.text != ref.text:
            wrong.append(f"stream {i}: text differs from its undisturbed run")
        if resumed is None:
            wrong.append(f"stream {i}: no token after the kill")
        elif resumed >= resume_within_s:
            wrong.append(
                f"stream {i} resumed {resumed:.2f} s after the replacement went live "
                f"(bound {resume_within_s:g} s)"
            )
    return wrong


async def run_phase(
    address: str,
    requests: list[dict[str, Any]],
    *,
    num_prefill: int,
    num_decode: int,
    resume_within_s: float,
    log: Callable[..., None],
) -> dict[str, Any]:
    """Run the phase on a quiet service at `num_prefill`P`num_decode`D; its numbers and
    `wrong` (empty when it passed). The pools are back at their sizes when it returns."""
    log("scaling decode to 1")
    await scale_pool(address, "decode", 1)
    await wait_pool_sizes(address, num_prefill, 1)
    reference = list(await asyncio.gather(*(generate(address, **r) for r in requests)))
    streams = [TimedStream([]) for _ in requests]

    async def timed(stream: TimedStream, request: dict[str, Any]) -> None:
        def arrived(n: int) -> None:
            stream.arrivals.append((time.monotonic(), n))

        stream.result = await generate(address, on_tokens=arrived, **request)

    calls = [asyncio.ensure_future(timed(s, r)) for s, r in zip(streams, requests, strict=True)]
    await wait_until_async(
        lambda: min(s.num_tokens for s in streams) >= MIN_TOKENS_BEFORE_KILL,
        120,
        what="every stream under way",
    )
    (victim,) = await live_workers(address, "decode")
    killed_at = time.monotonic()
    os.kill(victim.pid, signal.SIGKILL)
    tokens_at_kill = [s.num_tokens for s in streams]
    log("SIGKILL the only decode worker", worker=victim.worker_id, pid=victim.pid)

    async def replaced() -> admin_pb.WorkerDescription | None:
        """`victim`'s replacement once it is live."""
        live = await live_workers(address, "decode")
        return next(
            (w for w in live if w.worker_id == victim.worker_id and w.epoch != victim.epoch), None
        )

    replacement: admin_pb.WorkerDescription = await wait_until_async(
        replaced, 300, interval=0.1, what=f"{victim.worker_id}'s replacement live"
    )
    live_at = time.monotonic()
    log(
        f"{victim.worker_id} replaced",
        pid=replacement.pid,
        live_after_s=round(live_at - killed_at, 2),
    )
    _, late = await asyncio.wait(calls, timeout=END_WITHIN_S)
    for call in late:
        call.cancel()
    resumed_after_live_s = [
        None if (t := resumed_at(s.arrivals, killed_at)) is None else t - live_at for s in streams
    ]
    wrong = check(reference, streams, resumed_after_live_s, resume_within_s)
    log(f"scaling decode to {num_decode}")
    await scale_pool(address, "decode", num_decode)
    await wait_pool_sizes(address, num_prefill, num_decode)
    resumed = [r for r in resumed_after_live_s if r is not None]
    return {
        "streams": len(streams),
        "tokens_at_kill": tokens_at_kill,
        "tokens": [len(s.result.tokens) if s.result else s.num_tokens for s in streams],
        "undisturbed_tokens": [len(r.tokens) for r in reference],
        "outcomes": [s.result.outcome if s.result else None for s in streams],
        "replacement_live_after_kill_s": round(live_at - killed_at, 3),
        "resumed_after_live_s": [None if r is None else round(r, 3) for r in resumed_after_live_s],
        "worst_resumed_after_live_s": round(max(resumed), 3) if resumed else None,
        "resume_within_s": resume_within_s,
        "passed": not wrong,
        "wrong": wrong,
    }
