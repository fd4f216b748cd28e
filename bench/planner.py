"""The planner against static splits over one trace: a rate that doubles, then a mix that
switches from long prompts with short answers to short prompts with long answers. Every
system (`planner`: from 1P1D with `--planner --max-gpus N`; `P:D`: a static split) serves
the same seeded Poisson arrivals in its own service; per phase, SLO attainment and
goodput (bench.planner_report), and a plot of pool sizes and attainment over time.

    python -m bench.planner --profile cpu --out planner-cpu.json --plot planner-cpu.png
    # 4 GPUs, the 8B shape with random weights; one system per call (about 8 minutes):
    python -m bench.planner --profile gpu --systems planner --out p.json
    python -m bench.planner --profile gpu --systems 2:2 --out s22.json
    python -m bench.planner_report p.json s22.json ... --plot docs/img/planner_8b_4gpu.png

Any profile value can be overridden (`--rate`, `--phase-s`, `--long 2048:64`, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc

from bench.harness import ServiceProcess
from bench.load import parse_range
from bench.planner_report import plot, table
from bench.report import provenance
from bench.suite_common import KVGeometry, model_path

POOL_POLL_S = 1.0


@dataclass(frozen=True)
class Profile:
    """A trace and the services it runs against."""

    model: str | None  # a shape name ("8b", "1b"), a folder, or None: the embedded model
    budget: int  # --max-gpus of the planner
    splits: tuple[str, ...]  # static "P:D" splits of the same budget or less
    rate: float  # requests per second in the first phase (doubled after it)
    phase_s: float
    long: tuple[int, int]  # (prompt, output) tokens of phases 1 and 2
    short: tuple[int, int]  # ... of phase 3
    slo_ttft_ms: float
    slo_tpot_ms: float
    interval_s: float
    cooldown_s: float
    serve_args: tuple[str, ...] = ()
    startup_timeout_s: float = 600.0
    seed: int = 0


PROFILES = {
    "cpu": Profile(
        model=None,
        budget=3,
        splits=("1:1", "2:1", "1:2"),
        rate=0.3,
        phase_s=150,
        long=(256, 4),
        short=(16, 48),
        slo_ttft_ms=3000,
        slo_tpot_ms=300,
        interval_s=2,
        cooldown_s=10,
        serve_args=("--prefill-kv-cache-gib", "0.2", "--decode-kv-cache-gib", "0.2"),
    ),
    "gpu": Profile(
        model="8b",
        budget=4,
        splits=("1:3", "2:2", "3:1"),
        # About what 1P1D carries of the long mix, so that twice it needs a second
        # prefill worker, and the long-output phase more decode workers.
        rate=16.0,
        phase_s=120,
        long=(2048, 64),
        short=(256, 512),
        slo_ttft_ms=1000,
        slo_tpot_ms=50,
        interval_s=5,
        cooldown_s=20,
        # Uncompiled: a worker the planner adds is up in seconds, not minutes.
        serve_args=("--load-format", "dummy", "--no-compile", "--decode-max-num-seqs", "256"),
    ),
}


@dataclass
class Trace:
    arrivals: list[tuple[float, int, int, int]]  # (at_s, prompt, output, phase)
    phases: list[dict[str, Any]] = field(default_factory=list)


def make_trace(profile: Profile) -> Trace:
    """Three phases: the rate, twice the rate, twice the rate with the short mix."""
    rng = random.Random(profile.seed)
    plan = [
        (profile.rate, profile.long, "base rate, long prompts"),
        (2 * profile.rate, profile.long, "2x rate, long prompts"),
        (2 * profile.rate, profile.short, "2x rate, long outputs"),
    ]
    trace = Trace([])
    for number, (rate, (prompt, output), name) in enumerate(plan):
        start = number * profile.phase_s
        end = start + profile.phase_s
        trace.phases.append(
            {"name": name, "start_s": start, "end_s": end, "seconds": profile.phase_s,
             "rate": rate, "prompt_len": prompt, "output_len": output}
        )  # fmt: skip
        t = start + rng.expovariate(rate)
        while t < end:
            trace.arrivals.append((t, prompt, output, number))
            t += rng.expovariate(rate)
    return trace


async def _watch_pools(address: str, t0: float, stop: asyncio.Event, out: list[list[Any]]) -> None:
    """(t, live prefill, live decode, prefill target, decode target) every second."""
    from pdserve.v1 import admin_pb2 as admin_pb
    from router.cli.admin_client import list_workers

    while not stop.is_set():
        try:
            listing = await list_workers(address, timeout=5)
            live = [w.pool for w in listing.workers if w.state == admin_pb.WORKER_STATE_LIVE]
            out.append(
                [round(time.perf_counter() - t0, 2), live.count("prefill"), live.count("decode"),
                 listing.targets["prefill"], listing.targets["decode"]]
            )  # fmt: skip
        except grpc.aio.AioRpcError:
            pass  # a slow answer under load: the next sample comes a second later
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), POOL_POLL_S)


async def drive(address: str, trace: Trace, vocab: int, seed: int) -> tuple[list, list]:
    """Send the trace's arrivals on time; the pool samples and each request's record:
    (sent_s since the trace started, ttft_s or None, tpot_s or None, ok, phase)."""
    from bench.suite_service import drive as send

    rng = random.Random(seed + 1)
    prompts = [[rng.randrange(100, vocab - 1) for _ in range(a[1])] for a in trace.arrivals]
    pools: list[list[Any]] = []
    stop = asyncio.Event()
    watchers: list[asyncio.Task[None]] = []
    t0 = time.perf_counter()

    def watch() -> None:  # once connected, as the trace starts
        nonlocal t0
        t0 = time.perf_counter()
        watchers.append(asyncio.create_task(_watch_pools(address, t0, stop, pools)))

    sent, _ = await send(
        address, prompts, [a[2] for a in trace.arrivals],
        send_at=[a[0] for a in trace.arrivals], ready=watch,
    )  # fmt: skip
    stop.set()
    await asyncio.gather(*watchers)
    records = [
        [round(t.sent_s - t0, 3), t.ttft_s, t.tpot_s, t.ok, a[3]]
        for t, a in zip(sent, trace.arrivals, strict=True)
    ]
    return records, pools


def service_args(system: str, profile: Profile, model: Path | None) -> list[str]:
    args = ["--enable-admin", "--max-in-flight", "1024", "--max-queue", "4096"]
    args += ["--slo-ttft-ms", str(profile.slo_ttft_ms), "--slo-tpot-ms", str(profile.slo_tpot_ms)]
    if model is not None:
        args += ["--model", str(model)]
    if system == "planner":
        args += ["--planner", "--max-gpus", str(profile.budget)]
        args += ["--planner-interval-s", str(profile.interval_s)]
        args += ["--planner-cooldown-s", str(profile.cooldown_s)]
    else:
        prefill, decode = system.split(":")
        args += ["--prefill-workers", prefill, "--decode-workers", decode]
    return [*args, *profile.serve_args]


def run_system(system: str, profile: Profile, trace: Trace, workdir: Path) -> dict[str, Any]:
    model = None if profile.model is None else model_path(profile.model, workdir)
    vocab = KVGeometry.of(model).vocab_size if model is not None else 49152
    svc = ServiceProcess(service_args(system, profile, model), workdir / f"{system}.log")
    out: dict[str, Any] = {"args": svc.args}
    try:
        out["startup_s"] = round(svc.wait_serving(profile.startup_timeout_s), 1)
        print(f"{system}: serving after {out['startup_s']} s; {len(trace.arrivals)} requests")
        out["requests"], out["pools"] = asyncio.run(drive(svc.address, trace, vocab, profile.seed))
    finally:
        out["exit_code"] = svc.stop()
        if out["exit_code"] != 0 or "requests" not in out:
            out["log_tail"] = svc.log_tail()
    return out


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, Profile]:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--profile", choices=sorted(PROFILES), default="cpu")
    p.add_argument("--systems", help="comma-separated: planner and/or P:D splits (default: all)")
    p.add_argument("--out", type=Path, default=Path("planner.json"))
    p.add_argument("--plot", type=Path, help="PNG of pool sizes and attainment over time")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/pdserve-bench-planner"))
    for name in ("model", "budget", "rate", "phase-s", "slo-ttft-ms", "slo-tpot-ms",
                 "interval-s", "cooldown-s", "seed"):  # fmt: skip
        p.add_argument(f"--{name}", help="overrides the profile")
    p.add_argument("--long", type=parse_range, help="PROMPT:OUTPUT of phases 1 and 2")
    p.add_argument("--short", type=parse_range, help="PROMPT:OUTPUT of phase 3")
    ns = p.parse_args(argv)
    profile = PROFILES[ns.profile]
    types = {"budget": int, "seed": int, "model": str}
    for name in ("model", "budget", "rate", "phase_s", "slo_ttft_ms", "slo_tpot_ms",
                 "interval_s", "cooldown_s", "seed"):  # fmt: skip
        value = getattr(ns, name)
        if value is not None:
            profile = replace(profile, **{name: types.get(name, float)(value)})
    for name in ("long", "short"):
        if getattr(ns, name) is not None:
            profile = replace(profile, **{name: getattr(ns, name)})
    return ns, profile


def main(argv: list[str] | None = None) -> int:
    ns, profile = parse_args(argv)
    systems = ns.systems.split(",") if ns.systems else ["planner", *profile.splits]
    trace = make_trace(profile)
    ns.workdir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "provenance": provenance("bench.planner", argv),
        "profile": asdict(profile),
        "trace": {"phases": trace.phases, "slo_ttft_ms": profile.slo_ttft_ms,
                  "slo_tpot_ms": profile.slo_tpot_ms, "num_requests": len(trace.arrivals)},
        "systems": {},
    }  # fmt: skip
    for system in systems:
        result["systems"][system] = run_system(system, profile, trace, ns.workdir)
        ns.out.write_text(json.dumps(result, indent=1))  # each system as soon as it is done
    print(table(result))
    if ns.plot is not None:
        written = plot(result, ns.plot)
        print(f"plot: {written}" if written else "no plot: matplotlib is not installed")
    failed = [s for s, r in result["systems"].items() if r["exit_code"] != 0 or "requests" not in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
