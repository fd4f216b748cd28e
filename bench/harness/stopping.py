"""Stopping a running service the ways service managers do, with streams in flight, and
timing what its clients and its process see.

* "group": SIGTERM to the service's process group (`kill -- -PGID`: a terminal, a
  shell script, a supervisor that signals the group);
* "every-ray-first" / "every-router-first" / "every-shuffled": SIGTERM to every process
  of the service (the router, the local Ray's launcher, GCS, raylet, workers), as
  systemd's default control-group stop and container runtimes do, in the order named.

The service must have been started in a session of its own (`start_new_session=True`),
as a service manager starts it, so that its process group is its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import random
import signal
import subprocess
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness.polling import wait_until_async
from bench.harness.processes import process_alive, process_tree
from bench.harness.service import ServiceProcess
from bench.harness.streams import StreamResult, generate


def stop_fresh_service(
    log: Path, mode: str, drain_grace_s: float, *, rng: random.Random | None = None
) -> StopResult:
    """`pdserve serve` on the embedded model (metrics off), started in a session (process
    group) of its own as a service manager starts it, its output to `log`; once SERVING,
    stopped the way `mode` names with two streams in flight (`stop_with_streams`).
    Whatever happens, nothing of it is left running."""
    args = ["--metrics-port", "0", "--drain-grace-s", str(drain_grace_s)]
    svc = ServiceProcess(args, log, new_session=True)
    try:
        svc.wait_serving(300)
        return asyncio.run(stop_with_streams(svc.proc, svc.address, mode, rng=rng))
    finally:
        if svc.proc.poll() is None:
            os.killpg(svc.proc.pid, signal.SIGKILL)
        svc.stop()


STOP_MODES = ("group", "every-ray-first", "every-router-first", "every-shuffled")
FINISHED = ("final:FINISH_REASON_LENGTH", "final:FINISH_REASON_STOP")
ABORTED = "final:FINISH_REASON_ABORT"


@dataclass(frozen=True)
class StopResult:
    mode: str
    streams: list[StreamResult]
    final_after_s: list[float]  # per stream: from the signal to the end of its call
    exit_code: int | None  # None: still running at the deadline (then killed)
    exit_after_s: float  # from the signal to the process's exit
    survivors: list[int]  # the service's processes still alive 5 s after its exit
    tokens_at_signal: list[int]  # per stream: tokens received when the signal left

    @property
    def worst_final_s(self) -> float:
        return max(self.final_after_s, default=0.0)

    def record(self, wrong: list[str]) -> dict[str, Any]:
        """The stop as a JSON record, with what it got wrong (`problems`)."""
        return {
            "outcomes": [s.outcome for s in self.streams],
            "final_after_s": [round(s, 3) for s in self.final_after_s],
            "exit_code": self.exit_code,
            "exit_after_s": round(self.exit_after_s, 3),
            "survivors": self.survivors,
            "passed": not wrong,
            "wrong": wrong,
        }

    def problems(self, final_within_s: float, exit_within_s: float) -> list[str]:
        """What the stop got wrong; empty when it passed. Every stream ends with exactly
        one final message within `final_within_s` of the signal; after a signal to the
        group (a drain) that message is a FINISH, or an ABORT after tokens during the
        drain's grace (the signal must not reach the workers). The process exits 0
        within `exit_within_s`, with none of its processes left."""
        wrong = []
        for i, (stream, final_s, before) in enumerate(
            zip(self.streams, self.final_after_s, self.tokens_at_signal, strict=True)
        ):
            if stream.num_finals != 1 or stream.num_after_final:
                wrong.append(
                    f"stream {i}: {stream.num_finals} final messages "
                    f"({stream.num_after_final} after the first), {stream.outcome}"
                )
            elif self.mode == "group" and stream.outcome not in (*FINISHED, ABORTED):
                wrong.append(f"stream {i} ended with {stream.outcome}")
            elif (
                self.mode == "group" and stream.outcome == ABORTED and len(stream.tokens) <= before
            ):
                wrong.append(f"stream {i} got no token during the drain's grace before its ABORT")
            if final_s >= final_within_s:
                wrong.append(f"stream {i} ended {final_s:.2f} s after the signal")
        if self.exit_code != 0:
            wrong.append(f"exit status {self.exit_code} (None: still running, killed)")
        if self.exit_after_s >= exit_within_s:
            wrong.append(f"exited {self.exit_after_s:.2f} s after the signal")
        if self.survivors:
            wrong.append(f"processes of the service left running: {self.survivors}")
        return wrong


def send_stop(mode: str, router_pid: int, rng: random.Random | None = None) -> None:
    """Send SIGTERM the way `mode` names (STOP_MODES)."""
    if mode == "group":
        os.killpg(router_pid, signal.SIGTERM)
        return
    others = sorted(process_tree(router_pid) - {router_pid})
    if mode == "every-ray-first":
        order = [*others, router_pid]
    elif mode == "every-router-first":
        order = [router_pid, *others]
    elif mode == "every-shuffled":
        order = [router_pid, *others]
        (rng or random.Random()).shuffle(order)
    else:
        raise ValueError(f"unknown stop mode {mode!r}; one of {', '.join(STOP_MODES)}")
    for pid in order:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)


async def start_streams(
    address: str, waves: Sequence[Sequence[dict[str, Any]]]
) -> tuple[list[asyncio.Future[StreamResult]], list[int]]:
    """Start each wave of Generate calls (`generate` keywords) once every stream before it
    has tokens; once all have, the calls and the tokens each has had so far (kept up to
    date)."""
    seen: list[int] = []
    calls: list[asyncio.Future[StreamResult]] = []
    for wave in waves:
        for request in wave:
            seen.append(0)
            on_tokens = functools.partial(seen.__setitem__, len(calls))
            calls.append(asyncio.ensure_future(generate(address, on_tokens=on_tokens, **request)))
        await wait_until_async(lambda: min(seen) >= 2, 120, what="every stream under way")
    return calls, seen


async def stop_with_streams(
    proc: subprocess.Popen[bytes],
    address: str,
    mode: str,
    *,
    num_streams: int = 2,
    exit_timeout_s: float = 90.0,
    rng: random.Random | None = None,
) -> StopResult:
    """Start `num_streams` long streams, send the stop once each has tokens, and wait for
    the streams and the process: what each saw and when."""
    requests = [
        {"prompt": f"Count slowly, number {i}:", "max_tokens": 4000, "ignore_eos": True}
        for i in range(num_streams)
    ]
    calls, seen = await start_streams(address, [requests])
    return await stop_and_wait(proc, mode, calls, seen, exit_timeout_s=exit_timeout_s, rng=rng)


async def stop_and_wait(
    proc: subprocess.Popen[bytes],
    mode: str,
    calls: Sequence[Awaitable[StreamResult]],
    seen: list[int],
    *,
    exit_timeout_s: float = 90.0,
    rng: random.Random | None = None,
) -> StopResult:
    """Send the stop while `calls` stream (`seen`: the tokens each has had so far, kept up
    to date by the caller), then wait for the calls and the process: what each saw and
    when, and which of the service's processes outlived it."""
    service = process_tree(proc.pid)
    tokens_at_signal = list(seen)
    start = time.monotonic()
    send_stop(mode, proc.pid, rng)
    # The process first: a service that hangs would hold its streams open; killed, it
    # ends them.
    ending = asyncio.gather(*calls)
    loop = asyncio.get_running_loop()
    try:
        code: int | None = await loop.run_in_executor(None, proc.wait, exit_timeout_s)
    except subprocess.TimeoutExpired:
        code = None
    exit_after_s = time.monotonic() - start
    if code is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    streams = list(await ending)
    deadline = time.monotonic() + 5
    survivors = [pid for pid in service if process_alive(pid)]
    while survivors and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        survivors = [pid for pid in survivors if process_alive(pid)]
    return StopResult(
        mode,
        streams,
        [s.done_at - start for s in streams],
        code,
        exit_after_s,
        survivors,
        tokens_at_signal,
    )
