"""The soak's end: SIGTERM to the service's whole process group with streams in flight.

A terminal's Ctrl-C, a shell script's `kill -- -PGID` and supervisors that signal the
group stop the service this way (the service runs in a session of its own, so the
signal does not reach the soak). Long streams start first, short ones once those have
tokens, and the signal leaves once every stream has tokens: the short ones can finish
within the drain grace and the long ones cannot. Every stream must get exactly one final
message (FINISH, or ABORT when the grace ran out) within the grace plus a second, the
long ones must keep getting tokens through the grace (the signal must not reach the
workers), and the process must exit 0 within the grace plus 5 s with none of its
processes left.
"""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Callable
from typing import Any

from bench.harness.polling import wait_until_async
from bench.harness.stopping import StopResult, stop_and_wait
from bench.harness.streams import StreamResult, generate

FINAL_MARGIN_S = 1.0  # a stream's final message by the grace plus this
EXIT_MARGIN_S = 5.0  # the process's exit by the grace plus this


def check(result: StopResult, grace_s: float) -> list[str]:
    """What the stop got wrong; empty when it passed."""
    return result.problems(grace_s + FINAL_MARGIN_S, grace_s + EXIT_MARGIN_S)


async def run_phase(
    proc: subprocess.Popen[bytes],
    address: str,
    long_requests: list[dict[str, Any]],
    short_requests: list[dict[str, Any]],
    *,
    grace_s: float,
    log: Callable[..., None],
) -> dict[str, Any]:
    """Stop the service (`proc`, its own process group's leader, drained with `grace_s`)
    this way; the numbers and `wrong` (empty when it passed)."""
    requests = long_requests + short_requests
    seen = [0] * len(requests)

    def call(i: int) -> asyncio.Future[StreamResult]:
        return asyncio.ensure_future(
            generate(address, on_tokens=lambda n: seen.__setitem__(i, n), **requests[i])
        )

    calls = [call(i) for i in range(len(long_requests))]
    await wait_until_async(lambda: min(seen[: len(calls)]) >= 2, 120, what="long streams")
    calls += [call(i) for i in range(len(calls), len(requests))]
    await wait_until_async(lambda: min(seen) >= 2, 120, what="every stream under way")
    log("SIGTERM to the process group", streams=len(calls), tokens=list(seen))
    result = await stop_and_wait(proc, "group", calls, seen)
    wrong = check(result, grace_s)
    log("service exited", code=result.exit_code, after_s=round(result.exit_after_s, 2))
    return {
        "drain_grace_s": grace_s,
        "streams": len(result.streams),
        "outcomes": [s.outcome for s in result.streams],
        "tokens_at_signal": result.tokens_at_signal,
        "tokens": [len(s.tokens) for s in result.streams],
        "final_after_s": [round(s, 3) for s in result.final_after_s],
        "worst_final_after_s": round(result.worst_final_s, 3),
        "exit_code": result.exit_code,
        "exit_after_s": round(result.exit_after_s, 3),
        "survivors": result.survivors,
        "passed": not wrong,
        "wrong": wrong,
    }
