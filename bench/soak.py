"""Soak: a 2P2D service on CPU under Poisson load for ten minutes while workers die and the
decode pool grows and shrinks; every request must still complete, nothing may leak
(docs/operations.md describes its phases and checks).

    python -m bench.soak --out soak.json          # `make soak`

Then, on the quiet service, the only decode worker is SIGKILLed with streams on it (each
must complete with its undisturbed text, resuming within `--resume-within-s` of the
replacement going live), and the service is stopped by SIGTERM to its process group with
streams in flight (one final message each, exit 0 within the grace plus 5 s, nothing
left). Prints one summary, writes it as JSON; exits 1 naming each failed check.
`--quick`: two minutes of traffic, a kill every 30 s, a 15 s capacity run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.harness.metrics import scrape
from bench.harness.polling import wait_until_async
from bench.harness.pools import live_workers, wait_pool_sizes
from bench.harness.service import ServiceExitError, ServiceProcess, service_process
from bench.harness.stopping import StopResult, start_streams, stop_and_wait
from bench.harness.streams import StreamResult, TimedStream, generate
from bench.report import distribution, write_result
from pdserve.v1 import admin_pb2 as admin_pb
from router.cli.admin_client import scale_pool
from router.cli.client import get_pool_stats

SENTENCES = (
    "The river runs past the old mill and on to the sea.",
    "Bright lanterns swayed above the market as the traders packed their stalls.",
    "A careful engineer measures twice and changes one thing at a time.",
    "Snow covered the mountain pass long before the travellers reached it.",
)
NUM_PROMPTS = 12
NUM_PREFILL, NUM_DECODE = 2, 2
SOLE_DECODE_TOKENS = 64  # each stream's, when the only decode worker is killed
GROUP_STOP_LONG_TOKENS = 2000  # more than a stream gets in any drain grace on CPU
GROUP_STOP_SHORT_TOKENS = 16  # a few seconds: these finish within the grace
QUICK = {"duration_s": 120.0, "kill_every_s": 30.0, "calibrate_s": 15.0}
MIN_TOKENS_BEFORE_KILL = 8  # each stream's, so that every one is mid-way when it dies
COMPLETED = "final:FINISH_REASON_LENGTH"  # every request sets ignore_eos
# After the replacement is live, the streams get this long to end: a stream that waits
# for traffic that never comes is reported, and cancelled, not waited for.
END_WITHIN_S = 120.0
FINAL_MARGIN_S = 1.0  # the group stop: a stream's final message by the grace plus this
EXIT_MARGIN_S = 5.0  # the process's exit by the grace plus this


@dataclass(frozen=True)
class RequestKind:
    """One of the workload's requests; every run of it must give the same text."""

    prompt: str
    max_tokens: int
    seed: int | None  # None: greedy

    def kwargs(self) -> dict[str, Any]:
        sampling: dict[str, Any] = {"temperature": 0.0}
        if self.seed is not None:
            sampling = {"temperature": 0.8, "top_k": 40, "seed": self.seed}
        return {
            "prompt": self.prompt,
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
            **sampling,
        }


def workload() -> list[RequestKind]:
    """Prompts of about 40 to 250 tokens, 16 to 48 tokens out, half of them seeded."""
    kinds = []
    for i in range(NUM_PROMPTS):
        text = " ".join(SENTENCES[(i + j) % len(SENTENCES)] for j in range(2 + 3 * (i % 4)))
        kinds.append(
            RequestKind(f"Note {i}: {text}", 16 * (1 + i % 3), 1000 + i if i % 2 else None)
        )
    return kinds


def rss_mib(pid: int) -> float | None:
    """Resident memory of process `pid` in MiB; None when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


async def worker_rss(address: str) -> dict[str, float | None]:
    return {w.worker_id: rss_mib(w.pid) for w in await live_workers(address)}


def migrations(samples: dict[tuple[str, frozenset[tuple[str, str]]], float]) -> dict[str, float]:
    """pdserve_request_migrations_total by 'pool/reason'."""
    out = {}
    for (name, labels), value in samples.items():
        if name == "pdserve_request_migrations_total":
            tags = dict(labels)
            out[f"{tags['pool']}/{tags['reason']}"] = value
    return out


def restarts(samples: dict[tuple[str, frozenset[tuple[str, str]]], float]) -> float:
    return sum(v for (name, _), v in samples.items() if name == "pdserve_worker_restarts_total")


# ---------------------------------------------------------------- the end phases


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


def check_sole_decode(
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


async def sole_decode_kill(
    address: str,
    requests: list[dict[str, Any]],
    *,
    num_prefill: int,
    num_decode: int,
    resume_within_s: float,
    log: Callable[..., None],
) -> dict[str, Any]:
    """The phase with the only decode worker killed, on a quiet service at
    `num_prefill`P`num_decode`D: a few streams run undisturbed on the one decode worker
    left (the reference), then again until each has some tokens, when its process is
    SIGKILLed; nothing but the replacement going live may wake them. Its numbers and
    `wrong` (empty when it passed); the pools are back at their sizes after it."""
    log("scaling decode to 1")
    await scale_pool(address, "decode", 1)
    await wait_pool_sizes(address, num_prefill, 1)
    reference = list(await asyncio.gather(*(generate(address, **r) for r in requests)))
    streams = [TimedStream() for _ in requests]
    calls = [
        asyncio.ensure_future(s.run(address, **r)) for s, r in zip(streams, requests, strict=True)
    ]
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
    wrong = check_sole_decode(reference, streams, resumed_after_live_s, resume_within_s)
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


def check_group_stop(result: StopResult, grace_s: float) -> list[str]:
    """What the group stop got wrong; empty when it passed."""
    return result.problems(grace_s + FINAL_MARGIN_S, grace_s + EXIT_MARGIN_S)


async def group_stop(
    proc: subprocess.Popen[bytes],
    address: str,
    long_requests: list[dict[str, Any]],
    short_requests: list[dict[str, Any]],
    *,
    grace_s: float,
    log: Callable[..., None],
) -> dict[str, Any]:
    """SIGTERM to the service's process group (`proc` leads it; drained with `grace_s`)
    once long streams, then short ones, all have tokens: the short ones can finish within
    the grace, the long ones cannot and must keep getting tokens through it (the signal
    must not reach the workers). Its numbers and `wrong` (empty when it passed)."""
    calls, seen = await start_streams(address, [long_requests, short_requests])
    log("SIGTERM to the process group", streams=len(calls), tokens=list(seen))
    result = await stop_and_wait(proc, "group", calls, seen)
    log("service exited", code=result.exit_code, after_s=round(result.exit_after_s, 2))
    return {
        "drain_grace_s": grace_s,
        "streams": len(result.streams),
        "tokens_at_signal": result.tokens_at_signal,
        "tokens": [len(s.tokens) for s in result.streams],
        "worst_final_after_s": round(result.worst_final_s, 3),
        **result.record(check_group_stop(result, grace_s)),
    }


# ---------------------------------------------------------------- the soak


class Soak:
    def __init__(self, svc: ServiceProcess, args: argparse.Namespace) -> None:
        self.svc = svc
        self.args = args
        self.kinds = workload()
        self.rng = random.Random(args.seed)
        self.results: list[tuple[RequestKind, StreamResult, float]] = []
        self.events: list[dict[str, Any]] = []
        self.router_rss: list[tuple[float, float | None]] = []
        self.t0 = 0.0

    def log(self, what: str, **fields: Any) -> None:
        at = time.monotonic() - self.t0
        self.events.append({"at_s": round(at, 1), "event": what, **fields})
        print(f"[{at:6.1f} s] {what} {fields if fields else ''}", flush=True)

    async def one(self, kind: RequestKind) -> None:
        sent = time.monotonic()
        result = await generate(self.svc.address, timeout=self.args.timeout_s, **kind.kwargs())
        self.results.append((kind, result, result.done_at - sent))

    async def capacity(self) -> float:
        """Completed requests per second of a closed loop at `--concurrency`."""
        done = 0
        deadline = time.monotonic() + self.args.calibrate_s

        async def client() -> None:
            nonlocal done
            while time.monotonic() < deadline:
                result = await generate(self.svc.address, **self.rng.choice(self.kinds).kwargs())
                done += result.finish_reason in ("FINISH_REASON_LENGTH", "FINISH_REASON_STOP")

        start = time.monotonic()
        await asyncio.gather(*(client() for _ in range(self.args.concurrency)))
        return done / (time.monotonic() - start)

    async def traffic(self, rate: float) -> None:
        tasks = []
        end = self.t0 + self.args.duration_s
        while time.monotonic() < end:
            tasks.append(asyncio.ensure_future(self.one(self.rng.choice(self.kinds))))
            await asyncio.sleep(self.rng.expovariate(rate))
        self.log("traffic stopped", sent=len(tasks))
        await asyncio.gather(*tasks)

    async def chaos(self) -> None:
        """Kills (alternating pools) and one scale-up and scale-down, on a schedule."""
        duration, every = self.args.duration_s, self.args.kill_every_s
        plan: list[tuple[float, str]] = [
            (k * every, "kill prefill" if k % 2 else "kill decode")
            for k in range(1, int(duration // every) + 1)
            if k * every < duration
        ]
        plan += [(duration / 4, "scale decode 3"), (3 * duration / 4, "scale decode 2")]
        # Each on its own clock: a scale-up that takes a while delays no kill.
        await asyncio.gather(*(self.act(at, action) for at, action in plan))

    async def act(self, at: float, action: str) -> None:
        await asyncio.sleep(max(0.0, self.t0 + at - time.monotonic()))
        verb, pool, *size = action.split()
        if verb == "kill":
            await self.kill(pool)
            return
        self.log(f"scaling {pool} to {size[0]}")
        await scale_pool(self.svc.address, pool, int(size[0]))
        self.log(f"{pool} at {size[0]}")

    async def kill(self, pool: str) -> None:
        live = await live_workers(self.svc.address, pool)
        if not live:
            self.log(f"no live {pool} worker to kill")
            return
        victim = self.rng.choice(live)
        self.log("SIGKILL", worker=victim.worker_id, pid=victim.pid)
        os.kill(victim.pid, signal.SIGKILL)

    async def sample_rss(self) -> None:
        while True:
            self.router_rss.append((time.monotonic() - self.t0, rss_mib(self.svc.proc.pid)))
            await asyncio.sleep(self.args.rss_every_s)

    async def blocks_in_use(self) -> int:
        """Blocks held once every request ended (waits up to 30 s for releases to land)."""
        deadline = time.monotonic() + 30
        while True:
            stats = await get_pool_stats(self.svc.address)
            held = sum(w.num_blocks_in_use for w in stats.workers)
            if held == 0 or time.monotonic() > deadline:
                return held
            await asyncio.sleep(0.5)

    async def run(self) -> dict[str, Any]:
        self.t0 = time.monotonic()
        capacity = await self.capacity()
        rate = self.args.load * capacity
        self.log("capacity measured", req_per_s=round(capacity, 3), rate=round(rate, 3))
        self.results.clear()
        before = scrape(self.svc.metrics_port)[1]
        workers_start = await worker_rss(self.svc.address)
        self.t0 = time.monotonic()
        sampler = asyncio.ensure_future(self.sample_rss())
        await asyncio.gather(self.traffic(rate), self.chaos())
        sampler.cancel()
        self.router_rss.append((time.monotonic() - self.t0, rss_mib(self.svc.proc.pid)))
        held = await self.blocks_in_use()
        after = scrape(self.svc.metrics_port)[1]
        await wait_pool_sizes(self.svc.address, NUM_PREFILL, NUM_DECODE)  # the last kill's
        workers_end = await worker_rss(self.svc.address)
        summary = self.summary(capacity, rate, before, after, held, workers_start, workers_end)
        if self.args.sole_decode_kill:
            summary["sole_decode_kill"] = phase = await sole_decode_kill(
                self.svc.address,
                [replace(k, max_tokens=SOLE_DECODE_TOKENS).kwargs() for k in self.kinds[:4]],
                num_prefill=NUM_PREFILL,
                num_decode=NUM_DECODE,
                resume_within_s=self.args.resume_within_s,
                log=self.log,
            )
            phase["blocks_in_use_after"] = held = await self.blocks_in_use()
            if held:
                phase["passed"] = False
                phase["wrong"].append(f"{held} blocks in use after the phase")
        if self.args.group_stop:
            summary["group_stop"] = await group_stop(
                self.svc.proc,
                self.svc.address,
                [replace(k, max_tokens=GROUP_STOP_LONG_TOKENS).kwargs() for k in self.kinds[4:6]],
                [replace(k, max_tokens=GROUP_STOP_SHORT_TOKENS).kwargs() for k in self.kinds[:4]],
                grace_s=self.args.drain_grace_s,
                log=self.log,
            )
        return summary

    def summary(
        self,
        capacity: float,
        rate: float,
        before: Any,
        after: Any,
        held: int,
        workers_start: dict[str, float | None],
        workers_end: dict[str, float | None],
    ) -> dict[str, Any]:
        completed = [r for r in self.results if r[1].outcome == "final:FINISH_REASON_LENGTH"]
        failed = Counter(
            r.outcome for _, r, _ in self.results if r.outcome != "final:FINISH_REASON_LENGTH"
        )
        texts: dict[RequestKind, Counter[str]] = {}
        for kind, result, _ in completed:
            texts.setdefault(kind, Counter())[result.text] += 1
        mismatches = sum(sum(c.values()) - c.most_common(1)[0][1] for c in texts.values())
        moved_before, moved_after = migrations(before), migrations(after)
        router = [(t, m) for t, m in self.router_rss if m is not None]
        from_minute_2 = next((m for t, m in router if t >= 120), None)
        end_rss = router[-1][1] if router else None
        growth = (
            100 * (end_rss - from_minute_2) / from_minute_2 if from_minute_2 and end_rss else None
        )
        return {
            "capacity_req_per_s": capacity,
            "rate_req_per_s": rate,
            "duration_s": self.args.duration_s,
            "sent": len(self.results),
            "completed": len(completed),
            "failed": dict(failed),
            "text_mismatches": mismatches,
            "migrations": {k: moved_after[k] - moved_before.get(k, 0) for k in moved_after},
            "worker_restarts": restarts(after) - restarts(before),
            "blocks_in_use_after": held,
            "latency_s": distribution(d for _, _, d in completed),
            "rss_mib": {
                "router": {
                    "start": router[0][1] if router else None,
                    "minute_2": from_minute_2,
                    "end": end_rss,
                    "growth_from_minute_2_pct": growth,
                    "samples": [(round(t), round(m, 1)) for t, m in router],
                },
                "workers_start": workers_start,
                "workers_end": workers_end,
            },
            "events": self.events,
        }


def failures(s: dict[str, Any]) -> list[str]:
    """Every check the soak failed, one line each; empty when it passed."""
    wrong = []
    if s["failed"]:
        wrong.append(f"requests failed: {s['failed']}")
    if s["text_mismatches"]:
        wrong.append(f"{s['text_mismatches']} texts differ from other runs of their request")
    if s["blocks_in_use_after"]:
        wrong.append(f"{s['blocks_in_use_after']} blocks in use after the traffic")
    for phase, name in (
        ("sole_decode_kill", "only decode worker killed"),
        ("group_stop", "group SIGTERM"),
    ):
        wrong += [f"{name}: {w}" for w in s.get(phase, {}).get("wrong", [])]
    return wrong


def format_phases(s: dict[str, Any]) -> list[str]:
    lines = []
    if kill := s.get("sole_decode_kill"):
        lines.append(
            "only decode worker killed: replacement live "
            f"{kill['replacement_live_after_kill_s']:.1f} s after the kill; streams resumed "
            f"{kill['resumed_after_live_s']} s after it went live "
            f"(bound {kill['resume_within_s']:g} s); tokens {kill['tokens']} of "
            f"{kill['undisturbed_tokens']}; blocks in use after {kill['blocks_in_use_after']}"
        )
    if stop := s.get("group_stop"):
        outcomes = Counter(o.removeprefix("final:FINISH_REASON_") for o in stop["outcomes"])
        lines.append(
            f"group SIGTERM with {stop['streams']} streams (grace {stop['drain_grace_s']:g} s): "
            f"{dict(outcomes)}, last final {stop['worst_final_after_s']:.2f} s after the "
            f"signal; exit {stop['exit_code']} after {stop['exit_after_s']:.2f} s; "
            f"left running {stop['survivors'] or 'none'}"
        )
    return lines


def format_summary(s: dict[str, Any]) -> str:
    rss = s["rss_mib"]["router"]
    growth = rss["growth_from_minute_2_pct"]
    wrong = failures(s)
    return "\n".join(
        [
            f"capacity {s['capacity_req_per_s']:.2f} req/s; Poisson at {s['rate_req_per_s']:.2f} "
            f"req/s for {s['duration_s']:g} s",
            f"requests {s['completed']}/{s['sent']} completed; failed {s['failed'] or 0}; "
            f"texts differing from their other runs {s['text_mismatches']}",
            f"migrations {s['migrations']}; worker restarts {s['worker_restarts']:g}; "
            f"blocks in use after {s['blocks_in_use_after']}",
            f"router RSS {rss['start']:.0f} MiB at start, {rss['end']:.0f} MiB at end"
            + (f" ({growth:+.1f} % from minute 2)" if growth is not None else ""),
            f"worker RSS start {s['rss_mib']['workers_start']}",
            f"worker RSS end   {s['rss_mib']['workers_end']}",
            *format_phases(s),
            "passed" if not wrong else "FAILED:\n  " + "\n  ".join(wrong),
        ]
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.soak",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a short soak: "
        + ", ".join(f"--{k.replace('_', '-')} {v:g}" for k, v in QUICK.items()),
    )
    p.add_argument("--duration-s", type=float, default=600.0, help="of the Poisson traffic")
    p.add_argument("--kill-every-s", type=float, default=120.0, help="a worker SIGKILLed")
    p.add_argument("--load", type=float, default=0.7, help="share of the measured capacity")
    p.add_argument("--calibrate-s", type=float, default=45.0, help="closed-loop capacity run")
    p.add_argument("--concurrency", type=int, default=8, help="of the capacity run")
    p.add_argument("--rss-every-s", type=float, default=30.0)
    p.add_argument("--timeout-s", type=float, default=300.0, help="per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the summary as JSON here")
    p.add_argument("--log", help="the service's log; None: a temporary file")
    p.add_argument(
        "--sole-decode-kill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="after the traffic: kill the only decode worker with streams on it",
    )
    p.add_argument(
        "--resume-within-s",
        type=float,
        default=2.0,
        help="streams resume this soon after the only decode worker's replacement is live",
    )
    p.add_argument(
        "--group-stop",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="stop with SIGTERM to the service's process group, streams in flight",
    )
    p.add_argument("--drain-grace-s", type=float, default=10.0, help="the service's")
    if (argv if argv is not None else sys.argv[1:]).count("--quick"):
        p.set_defaults(**QUICK)
    return p.parse_args(argv)


SERVICE_ARGS = [
    "--prefill-workers", str(NUM_PREFILL), "--decode-workers", str(NUM_DECODE),
    "--enable-admin", "--prefill-kv-cache-gib", "0.25", "--decode-kv-cache-gib", "0.5",
]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log = Path(args.log or tempfile.mkstemp(prefix="soak-", suffix=".log")[1])
    print(f"service log: {log}", flush=True)
    service_args = [*SERVICE_ARGS, "--drain-grace-s", f"{args.drain_grace_s:g}"]
    summary: dict[str, Any] | None = None
    try:
        # In a session of its own for the group stop, whose signal must not reach us.
        with service_process(service_args, log, new_session=args.group_stop) as svc:
            svc.wait_serving(600)
            summary = asyncio.run(Soak(svc, args).run())
    except ServiceExitError:
        if summary is None or "group_stop" not in summary:
            raise  # the group stop's check names a bad exit status itself
    assert summary is not None
    summary["service_args"] = service_args
    print(format_summary(summary))
    if args.out:
        write_result(args.out, "bench.soak", argv, **summary)
    return 1 if failures(summary) else 0


if __name__ == "__main__":
    sys.exit(main())
