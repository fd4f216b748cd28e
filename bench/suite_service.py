"""GPU suite, service parts: `pdserve serve` as a subprocess, driven over gRPC.

* c:  1 prefill + 1 decode worker (one GPU each), the closed-loop runs of bench.suite_common;
* cc: 1 colocated worker (one GPU) behind the same router, the same runs: what the router
  and gRPC cost without a hand-off, so c against cc is the price of disaggregation.

bench.tp_goodput's probes (Poisson arrivals) use `Service` and `drive` too.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext, suppress
from pathlib import Path
from typing import Any

import grpc

from bench.harness import ServiceProcess as Service
from bench.harness.metrics import Samples, phase_means_ms, prefill_paths, scrape
from bench.suite_common import KVGeometry, ReqTiming, RunSpec, make_prompts, prompts_for, summarize

# ---------------------------------------------------------------- gRPC driver


async def call_generate(
    stub: Any, prompt: list[int], max_tokens: int, t: ReqTiming, timeout: float
) -> None:
    """One Generate call (greedy, EOS ignored), its times and final timings into `t`."""
    from pdserve.v1 import generation_pb2 as pb

    request = pb.GenerateRequest(
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    )
    request.prompt_token_ids.token_ids.extend(prompt)
    t.sent_s = time.perf_counter()
    try:
        call = stub.Generate(request, timeout=timeout)
        await call.initial_metadata()
        t.accepted_s = time.perf_counter()
        async for resp in call:
            now = time.perf_counter()
            if resp.token_ids:
                t.add_tokens(now, len(resp.token_ids))
            if resp.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                t.kv_transfer_s = resp.timings.kv_transfer_seconds
                t.kv_wire_s = resp.timings.kv_wire_seconds
                t.prefill_s = resp.timings.prefill_seconds
                t.router_ttft_s = resp.timings.time_to_first_token_seconds
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
    max_tokens: int | Sequence[int],
    *,
    concurrency: int | None = None,
    rate: float | None = None,
    send_at: Sequence[float] | None = None,
    seed: int = 0,
    timeout_s: float = 600.0,
    channels: int = 4,
    give_up: Callable[[list[ReqTiming], float], bool] | None = None,
    ready: Callable[[], None] | None = None,
    connections: bool = False,
) -> tuple[list[ReqTiming], float]:
    """Closed loop (`concurrency` in flight), open loop (Poisson `rate`) or a trace
    (request i sent `send_at[i]` s after the start); `max_tokens`: every request's, or
    each one's. Returns each request's timings and the wall time from the start to the
    last answer.

    `give_up(timings, now)`, checked every 0.1 s, ends the run early when it returns
    True: nothing more is sent and the calls in flight are cancelled (the router aborts
    them in every pool); those requests and the unsent ones end not ok. `ready()` runs
    once the channels are up, before the first send (several client processes start
    together through it). `connections`: each channel on a TCP connection of its own
    (a process's channels to one address share one otherwise): a router tier's
    processes each take whole connections."""
    from pdserve.v1 import generation_pb2_grpc as pb_grpc

    options = [("grpc.use_local_subchannel_pool", 1)] if connections else []
    chans = [grpc.aio.insecure_channel(address, options=options) for _ in range(channels)]
    stubs = [pb_grpc.GenerationServiceStub(c) for c in chans]
    limit = asyncio.Semaphore(concurrency) if concurrency else None
    rng = random.Random(seed)
    lengths = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
    timings = [ReqTiming(0.0) for _ in prompts]
    stop = asyncio.Event()
    try:
        for c in chans:
            await asyncio.wait_for(c.channel_ready(), timeout=30)
        if ready is not None:
            ready()

        async def one(i: int) -> None:
            async with limit or nullcontext():
                if not stop.is_set():
                    await call_generate(
                        stubs[i % channels], prompts[i], lengths[i], timings[i], timeout_s
                    )

        async def watch() -> None:
            assert give_up is not None
            while not stop.is_set():
                await asyncio.sleep(0.1)
                if give_up(timings, time.perf_counter()):
                    stop.set()

        watcher = asyncio.create_task(watch()) if give_up else None
        start = time.perf_counter()
        tasks = []
        for i in range(len(prompts)):
            if stop.is_set():
                break
            if send_at is not None:
                await asyncio.sleep(max(0.0, send_at[i] - (time.perf_counter() - start)))
            tasks.append(asyncio.create_task(one(i)))
            if rate and i + 1 < len(prompts):
                gap = rng.expovariate(rate)
                with suppress(TimeoutError):  # the gap to the next arrival, or a give-up
                    await asyncio.wait_for(stop.wait(), gap)
        if watcher is None:
            await asyncio.gather(*tasks)
        else:
            stopped: asyncio.Task[Any] = asyncio.create_task(stop.wait())
            pending: set[asyncio.Task[Any]] = set(tasks)
            while pending and not stop.is_set():
                _, pending = await asyncio.wait(
                    pending | {stopped}, return_when=asyncio.FIRST_COMPLETED
                )
                pending.discard(stopped)
            for task in pending:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            stop.set()
            await asyncio.gather(watcher, stopped, return_exceptions=True)
        wall = time.perf_counter() - start
    finally:
        for c in chans:
            await c.close()
    for t, length in zip(timings, lengths, strict=True):
        if t.ok and (t.sent_s == 0.0 or t.num_tokens < length):
            t.ok = False
            t.error = t.error or ("not sent: gave up" if t.sent_s == 0.0 else "cancelled: gave up")
    return timings, wall


def _drive_slice(
    address: str, prompts: list[list[int]], max_tokens: int, kw: dict[str, Any],
    barrier: Any, results: Any, slot: int,
) -> None:  # fmt: skip
    """One client process of `drive_processes`: its share of the prompts and of the
    concurrency (`kw`: `drive`'s keywords), started with the others."""
    timings, _ = asyncio.run(drive(address, prompts, max_tokens, ready=barrier.wait, **kw))
    results.put((slot, timings))


def drive_processes(
    address: str,
    prompts: list[list[int]],
    max_tokens: int,
    *,
    concurrency: int,
    processes: int,
    channels: int = 4,
    connections: bool = False,
) -> tuple[list[ReqTiming], float]:
    """`drive`'s closed loop spread over several client processes, for loads one Python
    client cannot read fast enough (it would time its own backlog as the service's).
    Prompts are dealt round robin, the concurrency split as evenly as it goes; every
    process sends its first request after all are connected. The timings come back in
    the prompts' order; the wall time runs from the first send to the last token, on the
    host's monotonic clock that every process shares."""
    processes = max(1, min(processes, concurrency, len(prompts)))
    kw: dict[str, Any] = {"channels": channels, "connections": connections}
    if processes == 1:
        return asyncio.run(drive(address, prompts, max_tokens, concurrency=concurrency, **kw))
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # this process has used grpc: no fork
    barrier, results = ctx.Barrier(processes), ctx.Queue()
    shares = [concurrency // processes + (i < concurrency % processes) for i in range(processes)]
    procs = [
        ctx.Process(
            target=_drive_slice,
            args=(
                address,
                prompts[i::processes],
                max_tokens,
                {**kw, "concurrency": shares[i]},
                barrier,
                results,
                i,
            ),
            daemon=True,
        )  # fmt: skip
        for i in range(processes)
    ]
    for proc in procs:
        proc.start()
    slices: dict[int, list[ReqTiming]] = {}
    try:
        while len(slices) < processes:
            slot, timings = results.get(timeout=900)
            slices[slot] = timings
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    timings = [ReqTiming(0.0)] * len(prompts)
    for slot, part in slices.items():
        timings[slot::processes] = part
    sent = [t.sent_s for t in timings if t.sent_s]
    ends = [t.last_s for t in timings if t.last_s is not None]
    wall = max(ends) - min(sent) if sent and ends else 0.0
    return timings, wall


# ---------------------------------------------------------------- c, cc


def check_warm_up(timings: list[ReqTiming]) -> None:
    """Raise with the errors when no warm-up request came back whole: the service is
    broken, and measuring it would only time errors."""
    if not any(t.ok for t in timings):
        raise RuntimeError(f"every warm-up request failed: {sorted({t.error for t in timings})}")


SYSTEMS = {  # part: (system name in the report, description, pool flags)
    "c": ("c_pdserve_1p1d_grpc", "1 prefill + 1 decode worker",
          ["--prefill-workers", "1", "--decode-workers", "1"]),
    "cc": ("cc_pdserve_colocated_grpc", "1 colocated worker behind the router",
           ["--colocated-workers", "1"]),
}  # fmt: skip


def service_args(
    model: Path,
    pool_flags: Sequence[str],
    disaggregated: bool,
    kv_cache_gib: float | None,
    max_num_seqs: int,
    *,
    drain_grace_s: float = 10,
    load_format: str = "dummy",
) -> list[str]:
    """`pdserve serve` flags of a benchmarked service: the pools, their KV cache (colocated
    workers take the decode knobs; none: on GPUs the workers size the cache from the
    device's free memory), and admission limits no load here reaches."""
    pools = ("prefill", "decode") if disaggregated else ("decode",)
    kv = [] if kv_cache_gib is None else [f"--{pool}-kv-cache-gib" for pool in pools]
    return [
        "--model", str(model), "--load-format", load_format, *pool_flags,
        *(arg for flag in kv for arg in (flag, str(kv_cache_gib))),
        "--decode-max-num-seqs", str(max_num_seqs), "--max-in-flight", "1024",
        "--max-queue", "4096", "--drain-grace-s", f"{drain_grace_s:g}",
    ]  # fmt: skip


def run_service_part(
    part: str, shape: str, model: Path, workdir: Path, ns: Any, *, plan: list[RunSpec]
) -> dict[str, Any]:
    """Part c (1P1D) or cc (one colocated worker) on its own service, with bench.gpu_suite's
    settings `ns`: every run of `plan`, each closed loop from `ns.client_processes` client
    processes."""
    system, config, pool_args = SYSTEMS[part]
    geo = KVGeometry.of(model)
    max_seqs = max(128, *(spec.concurrency for spec in plan)) if plan else 128
    args = service_args(model, pool_args, part == "c", ns.kv_cache_gib.get(shape, 8.0), max_seqs)
    svc = Service([*args, *ns.serve_extra], workdir / f"service-{part}-{shape}.log")
    out: dict[str, Any] = {"config": config, "args": svc.args}
    try:
        out["startup_s"] = round(svc.wait_serving(ns.startup_timeout), 2)
        out["on_gpus"] = "on GPUs" in svc.log_path.read_text(errors="replace")
        # The engine part's warm-up: the largest burst's prefill and a few decode steps,
        # one request alone, and the first prompt of every other length.
        main_len = max((s.prompt_len for s in plan if s.concurrency > 1), default=None)
        main_len = main_len or (plan[0].prompt_len if plan else 512)
        widest = max((s.concurrency for s in plan), default=1)
        warm = make_prompts(widest, main_len, geo.vocab_size, seed=97)
        warm_timings, _ = asyncio.run(drive(svc.address, warm, 4, concurrency=len(warm)))
        check_warm_up(warm_timings)
        asyncio.run(drive(svc.address, warm[:1], 4, concurrency=1))
        for length in sorted({s.prompt_len for s in plan} - {main_len}):
            other = make_prompts(1, length, geo.vocab_size, seed=98)
            asyncio.run(drive(svc.address, other, 4, concurrency=1))
        runs = []
        for spec in plan:
            prompts = prompts_for(shape, spec, geo.vocab_size)
            before = _samples(svc.metrics_port)
            timings, wall = drive_processes(
                svc.address, prompts, ns.output_len, concurrency=spec.concurrency,
                processes=ns.client_processes,
            )  # fmt: skip
            after = _samples(svc.metrics_port)
            transfers = [t.kv_transfer_s for t in timings if t.kv_transfer_s]
            p50 = round(1000 * statistics.median(transfers), 3) if transfers else None
            extra = {"prompt_len": spec.prompt_len, "rounds": spec.rounds,
                     "kv_transfer_ms_p50": p50, "phases_ms": phase_means_ms(before, after),
                     "prefill_paths": prefill_paths(before, after)}  # fmt: skip
            runs.append(summarize(system, spec.concurrency, timings, wall, **extra))
        out["runs"] = runs
    finally:
        out["exit_code"] = svc.stop()
        if out["exit_code"] != 0 or "startup_s" not in out:
            out["log_tail"] = svc.log_tail()
    return out


def _samples(metrics_port: int) -> Samples:
    """The service's metrics now (empty when they cannot be read: a run still counts)."""
    try:
        return scrape(metrics_port)[1]
    except OSError:
        return {}
