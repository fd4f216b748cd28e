"""GPU suite, service parts: `pdserve serve` as a subprocess, driven over gRPC.

* c: 1 prefill + 1 decode worker (one GPU each), closed loop at fixed concurrency;
* handoff: KV hand-off time (the final message's timings.kv_transfer_seconds) and the
  bytes it moved (from the KV layout) for prompts of 512 and 2048 tokens;
* goodput (DistServe): Poisson arrivals of long prompts at increasing rates; the highest
  rate at which >= 90% of requests meet both the TTFT and the TPOT objective.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import grpc

from bench.suite_common import (
    REPO,
    KVGeometry,
    ReqTiming,
    free_port,
    make_prompts,
    summarize,
    workload_seed,
)


class Service:
    """`python -m router.cli serve ARGS` on a free loopback port; log to a file."""

    def __init__(self, args: list[str], log_path: Path) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log_path = log_path
        self.args = args
        env = dict(os.environ)
        env.setdefault("RAY_AUTH_MODE", "disabled")
        env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        env["PYTHONUNBUFFERED"] = "1"
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "router.cli", "serve", "--port", str(self.port), *args],
            cwd=REPO,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def log_tail(self, n: int = 3000) -> str:
        return self.log_path.read_bytes()[-n:].decode(errors="replace")

    def wait_serving(self, timeout_s: float) -> float:
        """Seconds until health said SERVING; raises with the log's tail if it never does."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"service exited {self.proc.returncode}:\n{self.log_tail()}")
                try:
                    resp = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
                    if resp.status == health_pb2.HealthCheckResponse.SERVING:
                        return time.perf_counter() - self.started
                except grpc.RpcError:
                    pass
                time.sleep(0.25)
        raise TimeoutError(f"service not SERVING after {timeout_s:.0f}s:\n{self.log_tail()}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def serve_help() -> str:
    """`pdserve serve --help`, to see which flags this checkout has."""
    out = subprocess.run(
        [sys.executable, "-m", "router.cli", "serve", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return out.stdout


# ---------------------------------------------------------------- gRPC driver


async def _call(
    stub: Any, prompt: list[int], max_tokens: int, t: ReqTiming, timeout: float
) -> None:
    from pdserve.v1 import generation_pb2 as pb

    request = pb.GenerateRequest(
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    )
    request.prompt_token_ids.token_ids.extend(prompt)
    t.sent_s = time.perf_counter()
    try:
        async for resp in stub.Generate(request, timeout=timeout):
            now = time.perf_counter()
            if resp.token_ids:
                t.add_tokens(now, len(resp.token_ids))
            if resp.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                t.kv_transfer_s = resp.timings.kv_transfer_seconds
                t.kv_wire_s = resp.timings.kv_wire_seconds
                t.prefill_s = resp.timings.prefill_seconds
                if resp.finish_reason not in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP):
                    t.ok = False
                    t.error = pb.FinishReason.Name(resp.finish_reason) + ": " + resp.error[:200]
    except grpc.aio.AioRpcError as exc:
        t.ok = False
        t.error = f"{exc.code().name}: {(exc.details() or '')[:200]}"
    if t.ok and t.num_tokens != max_tokens:
        t.ok = False
        t.error = f"{t.num_tokens} tokens, asked {max_tokens}"


async def drive(
    address: str,
    prompts: list[list[int]],
    max_tokens: int,
    *,
    concurrency: int | None = None,
    rate: float | None = None,
    seed: int = 0,
    timeout_s: float = 600.0,
    channels: int = 4,
) -> tuple[list[ReqTiming], float]:
    """Closed loop (`concurrency` in flight) or open loop (Poisson `rate`); returns each
    request's timings and the wall time from the first send to the last answer."""
    from pdserve.v1 import generation_pb2_grpc as pb_grpc

    chans = [grpc.aio.insecure_channel(address) for _ in range(channels)]
    stubs = [pb_grpc.GenerationServiceStub(c) for c in chans]
    limit = asyncio.Semaphore(concurrency) if concurrency else None
    rng = random.Random(seed)
    timings = [ReqTiming(0.0) for _ in prompts]
    try:
        for c in chans:
            await asyncio.wait_for(c.channel_ready(), timeout=30)

        async def one(i: int) -> None:
            async with limit or nullcontext():
                await _call(stubs[i % channels], prompts[i], max_tokens, timings[i], timeout_s)

        start = time.perf_counter()
        tasks = []
        for i in range(len(prompts)):
            tasks.append(asyncio.create_task(one(i)))
            if rate and i + 1 < len(prompts):
                await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
    finally:
        for c in chans:
            await c.close()
    return timings, wall


# ---------------------------------------------------------------- c + handoff


def run_disaggregated(
    shape: str,
    model: Path,
    *,
    workdir: Path,
    concurrency: list[int],
    prompt_len: int,
    output_len: int,
    rounds_at_c1: int,
    kv_cache_gib: float,
    handoff_lens: list[int],
    handoff_samples: int,
    parts: set[str],
    startup_timeout_s: float,
    kv_itemsize: int = 2,
) -> dict[str, Any]:
    """Part c and the hand-off measurement on one 1P1D service."""
    geo = KVGeometry.of(model, kv_itemsize)
    kv = str(kv_cache_gib)
    svc = Service(
        [
            "--model",
            str(model),
            "--load-format",
            "dummy",
            "--prefill-kv-cache-gib",
            kv,
            "--decode-kv-cache-gib",
            kv,
            "--decode-max-num-seqs",
            str(max(128, *concurrency)),
            "--max-in-flight",
            "1024",
            "--max-queue",
            "4096",
            "--drain-grace-s",
            "10",
        ],
        workdir / f"service-1p1d-{shape}.log",
    )
    out: dict[str, Any] = {"config": "1 prefill + 1 decode worker", "args": svc.args}
    try:
        out["startup_s"] = round(svc.wait_serving(startup_timeout_s), 2)
        out["on_gpus"] = "on GPUs" in svc.log_path.read_text(errors="replace")
        # The engine part's warm-up: the largest burst's prefill and a few decode steps.
        warm = make_prompts(max(concurrency), prompt_len, geo.vocab_size, seed=97)
        asyncio.run(drive(svc.address, warm, 4, concurrency=len(warm)))
        asyncio.run(drive(svc.address, warm[:1], 4, concurrency=1))
        if "c" in parts:
            runs = []
            for c in concurrency:
                seed = workload_seed(shape, c, prompt_len)
                if c == 1:
                    prompts = [
                        make_prompts(1, prompt_len, geo.vocab_size, seed + r)[0]
                        for r in range(rounds_at_c1)
                    ]
                else:
                    prompts = make_prompts(c, prompt_len, geo.vocab_size, seed)
                timings, wall = asyncio.run(drive(svc.address, prompts, output_len, concurrency=c))
                transfers = [t.kv_transfer_s for t in timings if t.kv_transfer_s]
                runs.append(
                    summarize(
                        "c_pdserve_1p1d_grpc",
                        c,
                        timings,
                        wall,
                        kv_transfer_ms_p50=round(1000 * statistics.median(transfers), 3)
                        if transfers
                        else None,
                    )
                )
            out["runs"] = runs
        if "handoff" in parts:
            out["handoff"] = [
                handoff_stats(svc.address, geo, n, handoff_samples) for n in handoff_lens
            ]
    finally:
        out["exit_code"] = svc.stop()
        if out["exit_code"] != 0 or "startup_s" not in out:
            out["log_tail"] = svc.log_tail()
    return out


def handoff_stats(address: str, geo: KVGeometry, prompt_len: int, samples: int) -> dict:
    """Single requests in turn (max_tokens 2): hand-off seconds and the bytes moved."""
    prompts = make_prompts(samples, prompt_len, geo.vocab_size, seed=5000 + prompt_len)
    timings, _ = asyncio.run(drive(address, prompts, 2, concurrency=1))
    secs = [t.kv_transfer_s for t in timings if t.ok and t.kv_transfer_s]
    nbytes = geo.handoff_bytes(prompt_len)
    if not secs:
        return {"prompt_len": prompt_len, "bytes": nbytes, "error": timings[0].error}
    med = statistics.median(secs)
    wires = [t.kv_wire_s for t in timings if t.ok and t.kv_wire_s]
    wire = statistics.median(wires) if wires else None
    return {
        # The data movement alone (receive posted → complete on the decode side).
        "wire_seconds_p50": wire,
        "wire_gib_s_p50": round(nbytes / wire / 2**30, 2) if wire else None,
        "prompt_len": prompt_len,
        "bytes": nbytes,
        "samples": len(secs),
        "seconds_p50": med,
        "seconds_min": min(secs),
        "gib_s_p50": round(nbytes / med / 2**30, 2),
        "ttft_ms_p50": round(1000 * statistics.median(t.ttft_s or 0 for t in timings), 3),
        "prefill_ms_p50": round(1000 * statistics.median(t.prefill_s or 0 for t in timings), 3),
    }


# ---------------------------------------------------------------- goodput


def run_goodput(
    system: str,
    serve_args: list[str],
    model: Path,
    *,
    workdir: Path,
    rates: list[float],
    duration_s: float,
    min_requests: int,
    prompt_len: int,
    output_len: int,
    ttft_slo_s: float,
    tpot_slo_s: float,
    attainment: float,
    startup_timeout_s: float,
    deadline: float = float("inf"),
) -> dict[str, Any]:
    """Rates in increasing order until attainment drops below the target (or the
    `deadline`, a time.perf_counter() value, would be passed by the next rate)."""
    geo = KVGeometry.of(model)
    svc = Service(
        ["--model", str(model), "--load-format", "dummy", *serve_args],
        workdir / f"service-goodput-{system}.log",
    )
    out: dict[str, Any] = {"system": system, "args": svc.args, "points": []}
    try:
        out["startup_s"] = round(svc.wait_serving(startup_timeout_s), 2)
        out["on_gpus"] = "on GPUs" in svc.log_path.read_text(errors="replace")
        warm = make_prompts(4, prompt_len, geo.vocab_size, seed=96)
        asyncio.run(drive(svc.address, warm, 4, concurrency=4))
        best = 0.0
        for rate in rates:
            n = max(min_requests, round(rate * duration_s))
            if time.perf_counter() + n / rate + 10 > deadline:
                out["stopped"] = f"time budget: rate {rate} and above not run"
                break
            prompts = make_prompts(n, prompt_len, geo.vocab_size, seed=int(rate * 1000) + 7)
            timings, wall = asyncio.run(
                drive(svc.address, prompts, output_len, rate=rate, seed=int(rate * 100))
            )
            met = sum(
                1
                for t in timings
                if t.ok
                and t.ttft_s is not None
                and t.ttft_s <= ttft_slo_s
                and (t.tpot_s is None or t.tpot_s <= tpot_slo_s)
            )
            point = summarize(system, 0, timings, wall, rate=rate, slo_attainment=met / n)
            out["points"].append(point)
            if met / n >= attainment:
                best = rate
            else:
                break  # higher rates only queue more
        out["max_rate_meeting_slo"] = best
    finally:
        out["exit_code"] = svc.stop()
        if out["exit_code"] != 0 or "startup_s" not in out:
            out["log_tail"] = svc.log_tail()
    return out
