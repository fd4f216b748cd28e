"""GPU suite, goodput part (DistServe's measure): where disaggregation pays.

Requests of `prompt_len` tokens asking for `output_len` arrive as a Poisson process. A
request meets an SLO when its TTFT <= the TTFT objective and its TPOT <= the TPOT
objective; a rate is sustained at that SLO when >= `attainment` of its requests meet it.
The systems: every split of N GPUs into prefill and decode workers, and N colocated
replicas behind the same router as the baseline. Every request's TTFT and TPOT is kept,
so one sweep of rates gives the highest rate sustained at each TPOT objective (15, 25,
50 ms).

A split's router aims its local-prefill rule at a TPOT target (`--slo-tpot-ms`), so a
split is swept once per TPOT objective, its router aimed at that one (`--goodput-aim
slo`, the default; through the admin API between sweeps of one service, with prompts of
its own each sweep; each point records `aimed_tpot_ms`, and an objective's highest rate
comes from the sweep aimed at it), as an operator would deploy it for that objective;
colocated replicas have no such rule and run one sweep. `--goodput-aim router-default`
runs every system once, at the router's default targets.

A sweep (`RateSearch`) doubles the rate from `--goodput-start-rate` while its SLO (the
one it is aimed at, else the loosest) is sustained, stops at the first rate where it is
not, and bisects once between the last rate sustained and that one. A rate whose misses
at that SLO already exceed what the attainment allows is cut short: nothing more is
sent, the calls in flight are cancelled (the router aborts them), the unsent requests
count as misses.
`--goodput-budget` bounds the whole part (a rate that would overrun it is not started);
`--goodput-systems` runs a subset, so a sweep of 4 GPUs can be split over several
commands; `python -m bench.suite_report FILE.json...` prints the tables of several runs, merged.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.suite_common import KVGeometry, ReqTiming, error_record, make_prompts, summarize

DEFAULT_TPOT_SLOS_MS = "15,25,50"


def slo_key(tpot_ms: float) -> str:
    """The JSON key of a TPOT objective: 25.0 -> '25'."""
    return f"{tpot_ms:g}"


def goodput_systems(gpus: int) -> dict[str, list[str]]:
    """Every prefill/decode split of `gpus` GPUs (most prefill first), then the colocated
    baseline: `gpus` replicas behind the router."""
    systems = {
        f"{p}p{gpus - p}d": ["--prefill-workers", str(p), "--decode-workers", str(gpus - p)]
        for p in range(gpus - 1, 0, -1)
    }
    systems[f"colocated_x{gpus}"] = ["--colocated-workers", str(gpus)]
    return systems


# ---------------------------------------------------------------- SLO arithmetic


def meets(
    ok: bool, ttft_ms: float | None, tpot_ms: float | None, ttft_slo_ms: float, tpot_slo_ms: float
) -> bool:
    """One request against one SLO; a one-token answer has no TPOT and cannot miss it."""
    if not ok or ttft_ms is None or ttft_ms > ttft_slo_ms:
        return False
    return tpot_ms is None or tpot_ms <= tpot_slo_ms


def attainment(requests: dict[str, list], ttft_slo_ms: float, tpot_slo_ms: float) -> float:
    """Fraction of a point's requests (sent or not) meeting the SLO, from its per-request
    lists `ok`, `ttft_ms`, `tpot_ms`."""
    rows = list(zip(requests["ok"], requests["ttft_ms"], requests["tpot_ms"], strict=True))
    if not rows:
        return 0.0
    return sum(meets(ok, a, b, ttft_slo_ms, tpot_slo_ms) for ok, a, b in rows) / len(rows)


def points_for(points: list[dict], key: str) -> list[dict]:
    """The points that speak for TPOT objective `key`: those of the sweep aimed at it,
    and those of a sweep aimed at none."""
    return [p for p in points if p.get("aimed_tpot_ms") in (None, float(key))]


def max_rate_sustained(points: list[dict], key: str, target: float) -> tuple[float, bool]:
    """The highest rate sustained at SLO `key` with every lower rate sustained too (0
    when none is), and whether a higher rate was run and missed it (False: the true
    maximum may be higher, only a lower bound)."""
    best = 0.0
    for pt in sorted(points_for(points, key), key=lambda p: p["rate"]):
        if pt["attainment"][key] < target:
            return best, True
        best = pt["rate"]
    return best, False


def definitely_missed(
    t: ReqTiming, now: float, ttft_slo_s: float, tpot_slo_s: float, output_len: int
) -> bool:
    """Whether a request in flight can no longer meet the SLO, whatever comes next."""
    if not t.ok:
        return True
    if t.first_s is None:
        return now - t.sent_s > ttft_slo_s
    if t.first_s - t.sent_s > ttft_slo_s:
        return True
    if output_len < 2:
        return False
    last = t.last_s if t.num_tokens >= output_len else now  # the last token comes later
    return (last - t.first_s) / (output_len - 1) > tpot_slo_s  # type: ignore[operator]


def give_up_when_missed(
    n: int, target: float, ttft_slo_s: float, tpot_slo_s: float, output_len: int
) -> Callable[[list[ReqTiming], float], bool]:
    """drive's give_up: True once more requests surely missed than `target` allows."""
    allowed = math.floor((1 - target) * n + 1e-9)

    def give_up(timings: list[ReqTiming], now: float) -> bool:
        missed = sum(
            1
            for t in timings
            if t.sent_s and definitely_missed(t, now, ttft_slo_s, tpot_slo_s, output_len)
        )
        return missed > allowed

    return give_up


@dataclass(frozen=True)
class RateSearch:
    """Which rate to run next, from the rates run so far (rate -> sustained at the
    loosest SLO). Fixed `rates`: in order until the first one not sustained."""

    start: float
    max_rate: float
    min_rate: float = 0.25
    bisections: int = 1
    rates: tuple[float, ...] = ()

    def _on_grid(self, rate: float) -> bool:
        steps = math.log2(rate / self.start)
        return abs(steps - round(steps)) < 1e-6

    def next_rate(self, results: dict[float, bool]) -> float | None:
        if self.rates:
            if not all(results.values()):
                return None
            return next((r for r in self.rates if r not in results), None)
        if not results:
            return self.start
        passed = sorted(r for r, ok in results.items() if ok)
        failed = sorted(r for r, ok in results.items() if not ok)
        if not failed:  # double while sustained
            top = passed[-1]
            return None if top >= self.max_rate else min(2 * top, self.max_rate)
        below = [r for r in passed if r < failed[0]]
        if not below:  # even the first rate failed: halve
            low = failed[0] / 2
            return low if low >= self.min_rate else None
        lo, hi = below[-1], failed[0]
        done = sum(1 for r in results if not self._on_grid(r))
        if done >= self.bisections or hi / lo < 1.1:
            return None
        return round((lo + hi) / 2, 3)


# ---------------------------------------------------------------- running


def add_goodput_args(p: argparse.ArgumentParser) -> None:
    """The goodput part's flags (bench.gpu_suite)."""
    g = p.add_argument_group("goodput")
    g.add_argument("--gpus", type=int, default=2, help="GPUs per goodput system (2 or 4)")
    g.add_argument("--goodput-systems", help="comma list (default: every split + colocated)")
    g.add_argument("--goodput-shape", help="default 8b (quick: the first shape)")
    g.add_argument("--goodput-rates", help="req/s, increasing; default: the doubling search")
    g.add_argument("--goodput-start-rate", type=float, help="default 4 (quick: 2) req/s")
    g.add_argument("--goodput-max-rate", type=float, default=128.0)
    g.add_argument("--goodput-duration", type=float, help="s of arrivals per rate; default 8")
    g.add_argument("--goodput-min-requests", type=int, help="per rate; default 16 (quick: 8)")
    g.add_argument("--goodput-prompt-len", type=int, default=2048)
    g.add_argument("--goodput-output-len", type=int, default=128)
    g.add_argument("--goodput-budget", type=float, help="s for the whole part (default: all)")
    g.add_argument(
        "--goodput-kv-cache-gib",
        type=float,
        help="per worker (default: on CUDA each worker sizes its cache from free memory; "
        "on CPU the shape's --kv-cache-gib)",
    )
    g.add_argument("--goodput-max-num-seqs", type=int, default=256, help="decode / colocated")
    g.add_argument("--ttft-slo", type=float, default=1.0, help="seconds")
    g.add_argument("--tpot-slos", default=DEFAULT_TPOT_SLOS_MS, help="ms per output token")
    g.add_argument("--attainment", type=float, default=0.9)
    g.add_argument(
        "--goodput-aim",
        choices=("slo", "router-default"),
        default="slo",
        help="slo: each split once per TPOT objective, its router aimed at it "
        "(--slo-tpot-ms); router-default: every system once, at the router's defaults",
    )


def resolve_goodput_args(ns: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    """Defaults that depend on --quick and the shapes; lists parsed."""
    quick = ns.quick

    def pick(value: Any, full: Any, small: Any) -> Any:
        return value if value is not None else (small if quick else full)

    if ns.gpus < 2:
        p.error("--gpus must be >= 2 (one prefill and one decode worker at least)")
    ns.goodput_shape = pick(ns.goodput_shape, "8b", ns.shapes[0])
    ns.goodput_rates = [float(r) for r in (ns.goodput_rates or "").split(",") if r]
    ns.goodput_start_rate = pick(ns.goodput_start_rate, 4.0, 2.0)
    ns.goodput_duration = pick(ns.goodput_duration, 8.0, 3.0)
    ns.goodput_min_requests = pick(ns.goodput_min_requests, 16, 8)
    ns.tpot_slos = sorted(float(x) for x in ns.tpot_slos.split(",") if x)
    if not ns.tpot_slos:
        p.error("--tpot-slos needs at least one value")
    systems = ns.goodput_systems
    ns.goodput_systems = [x for x in systems.split(",") if x] if systems else None
    if ns.goodput_systems:
        unknown = set(ns.goodput_systems) - set(goodput_systems(ns.gpus))
        if unknown:
            p.error(
                f"--goodput-systems {sorted(unknown)}: with --gpus {ns.gpus} choose from "
                + ", ".join(goodput_systems(ns.gpus))
            )


def gpu_count() -> int | None:
    """GPUs nvidia-smi lists; None without nvidia-smi."""
    if not shutil.which("nvidia-smi"):
        return None
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


async def settle(address: str, timeout_s: float = 60.0) -> float:
    """Seconds until the router and every worker hold nothing (after cancelled calls)."""
    from router.cli.client import get_pool_stats

    start = time.perf_counter()
    while time.perf_counter() - start < timeout_s:
        stats = await get_pool_stats(address)
        busy = stats.num_in_flight or stats.num_queued
        busy = busy or any(w.num_running or w.num_waiting for w in stats.workers)
        if not busy:
            break
        await asyncio.sleep(0.2)
    return round(time.perf_counter() - start, 2)


def run_point(
    address: str,
    geo: KVGeometry,
    ns: argparse.Namespace,
    rate: float,
    tpot_slo_ms: float,
    sweep: int = 0,
) -> dict:
    """One rate: Poisson arrivals of the same prompts and gaps for every system (the
    `sweep`-th of one service gets prompts of its own: none found in its cache); cut
    short once the misses at `tpot_slo_ms` (the sweep's objective) are past saving."""
    from bench.suite_service import drive

    n = max(ns.goodput_min_requests, round(rate * ns.goodput_duration))
    seed = int(rate * 1000) + 7 + 1_000_003 * sweep
    prompts = make_prompts(n, ns.goodput_prompt_len, geo.vocab_size, seed=seed)
    give_up = give_up_when_missed(
        n, ns.attainment, ns.ttft_slo, tpot_slo_ms / 1000, ns.goodput_output_len
    )
    timings, wall = asyncio.run(
        drive(
            address,
            prompts,
            ns.goodput_output_len,
            rate=rate,
            seed=int(rate * 100),
            give_up=give_up,
            timeout_s=max(120.0, 4 * n / rate),
        )
    )
    first = min((t.sent_s for t in timings if t.sent_s), default=0.0)

    def ms(x: float | None) -> float | None:
        return None if x is None else round(1000 * x, 3)

    requests: dict[str, list[Any]] = {
        "sent_ms": [ms(t.sent_s - first) if t.sent_s else None for t in timings],
        "ok": [t.ok for t in timings],
        "ttft_ms": [ms(t.ttft_s) for t in timings],
        "tpot_ms": [ms(t.tpot_s) for t in timings],
    }
    met = {
        slo_key(slo): round(attainment(requests, 1000 * ns.ttft_slo, slo), 4)
        for slo in ns.tpot_slos
    }
    gave_up = any(t.error.endswith("gave up") for t in timings)
    point = summarize("", 0, timings, wall, rate=rate, attainment=met, gave_up=gave_up)
    del point["system"], point["concurrency"]
    point["settle_s"] = asyncio.run(settle(address))
    point["requests"] = requests
    return point


def aims(system: str, ns: argparse.Namespace) -> list[float | None]:
    """The TPOT targets a system's router is aimed at, one sweep each (None: the
    router's default)."""
    if ns.goodput_aim == "router-default" or system.startswith("colocated"):
        return [None]
    return list(ns.tpot_slos)


def run_system(
    system: str,
    pool_args: list[str],
    model: Path,
    ns: argparse.Namespace,
    workdir: Path,
    deadline: float,
) -> dict[str, Any]:
    """One service, and a sweep of rates for each of its aims: between sweeps its
    router is aimed at the next objective through the admin API (`SetPrefillPolicy`),
    as an operator would, so the service starts once."""
    from bench.suite_service import Service, check_warm_up, drive, kv_args

    kv = ns.goodput_kv_cache_gib
    if kv is None and ns.device != "cuda":
        kv = ns.kv_cache_gib.get(ns.goodput_shape, 0.25)
    targets = aims(system, ns)
    args = ["--model", str(model), "--load-format", "dummy", *pool_args]
    args += kv_args(not system.startswith("colocated"), kv)
    args += ["--decode-max-num-seqs", str(ns.goodput_max_num_seqs)]
    args += ["--max-in-flight", "1024", "--max-queue", "4096", "--drain-grace-s", "10"]
    if targets != [None]:
        args += ["--enable-admin"]
    started = time.perf_counter()
    svc = Service([*args, *ns.serve_extra], workdir / f"service-goodput-{system}.log")
    out: dict[str, Any] = {"system": system, "gpus": ns.gpus, "args": svc.args, "points": []}
    try:
        startup_timeout = min(ns.startup_timeout, deadline - time.perf_counter() - 20)
        out["startup_s"] = round(svc.wait_serving(max(startup_timeout, 1.0)), 2)
        out["on_gpus"] = "on GPUs" in svc.log_path.read_text(errors="replace")
        geo = KVGeometry.of(model)
        warm = make_prompts(2 * ns.gpus, ns.goodput_prompt_len, geo.vocab_size, seed=96)
        warm_timings, _ = asyncio.run(drive(svc.address, warm, 4, concurrency=len(warm)))
        check_warm_up(warm_timings)
        out["warm_settle_s"] = asyncio.run(settle(svc.address))
        out["workers"] = asyncio.run(worker_blocks(svc.address))
        for sweep, aim in enumerate(targets):
            if aim is not None:
                asyncio.run(aim_router(svc.address, aim, ns.ttft_slo))
            stopped = run_sweep(system, svc.address, geo, ns, deadline, aim, sweep, out["points"])
            if stopped:
                out["stopped"] = stopped
                break
    finally:
        out["exit_code"] = svc.stop()
        out["elapsed_s"] = round(time.perf_counter() - started, 1)  # start to stopped
        if out["exit_code"] != 0 or "startup_s" not in out:
            out["log_tail"] = svc.log_tail()
    out["points"].sort(key=lambda p: p["rate"])
    out["max_rate"], out["max_rate_exact"] = {}, {}
    for slo in ns.tpot_slos:
        key = slo_key(slo)
        out["max_rate"][key], out["max_rate_exact"][key] = max_rate_sustained(
            out["points"], key, ns.attainment
        )
    return out


def run_sweep(
    system: str,
    address: str,
    geo: KVGeometry,
    ns: argparse.Namespace,
    deadline: float,
    aim: float | None,
    sweep: int,
    points: list[dict],
) -> str | None:
    """One sweep of rates, searched at `aim` (None: the loosest objective), its points
    added to `points`; why it stopped early, if it did."""
    search_slo = aim if aim is not None else max(ns.tpot_slos)
    search = RateSearch(ns.goodput_start_rate, ns.goodput_max_rate, rates=tuple(ns.goodput_rates))
    results: dict[float, bool] = {}
    label = system + ("" if aim is None else f" aimed at {aim:g} ms")
    while (rate := search.next_rate(results)) is not None:
        n = max(ns.goodput_min_requests, round(rate * ns.goodput_duration))
        need = n / rate + ns.ttft_slo + ns.goodput_output_len * search_slo / 1000
        if time.perf_counter() + need + 25 > deadline:
            return f"time budget: {label}, rate {rate} not run"
        print(f"  goodput {label}: rate {rate} req/s, {n} requests", flush=True)
        point = run_point(address, geo, ns, rate, search_slo, sweep)
        if aim is not None:
            point["aimed_tpot_ms"] = aim
        points.append(point)
        results[rate] = point["attainment"][slo_key(search_slo)] >= ns.attainment
        failed = [e for e in point["errors"] if not e.endswith("gave up")]
        if failed and point["num_ok"] == 0:
            return f"every request failed at rate {rate}: {failed[0]}"
    return None


async def aim_router(address: str, tpot_ms: float, ttft_s: float) -> None:
    """The router's local-prefill rule aimed at these targets from now on."""
    from pdserve.v1 import admin_pb2
    from router.cli.admin_client import set_prefill_policy

    request = admin_pb2.SetPrefillPolicyRequest(slo_tpot_ms=tpot_ms, slo_ttft_ms=1000 * ttft_s)
    await set_prefill_policy(address, request)


async def worker_blocks(address: str) -> dict[str, int]:
    """KV blocks of each worker, as it sized its cache."""
    from pdserve.v1 import generation_pb2 as pb
    from router.cli.client import get_pool_stats

    stats = await get_pool_stats(address)
    return {
        f"{pb.Pool.Name(w.pool).removeprefix('POOL_').lower()}-{w.index}": w.num_blocks_total
        for w in stats.workers
    }


def run_goodput_part(ns: argparse.Namespace, workdir: Path, deadline: float) -> dict[str, Any]:
    """Every chosen system of `ns.gpus` GPUs, one after the other, within the budget."""
    from bench.suite_common import shape_path

    if ns.goodput_budget is not None:
        deadline = min(deadline, time.perf_counter() + ns.goodput_budget)
    model = shape_path(ns.goodput_shape, workdir)
    out: dict[str, Any] = {
        "shape": ns.goodput_shape,
        "gpus": ns.gpus,
        "prompt_len": ns.goodput_prompt_len,
        "output_len": ns.goodput_output_len,
        "slo": {"ttft_s": ns.ttft_slo, "tpot_ms": ns.tpot_slos, "attainment": ns.attainment},
        "duration_s": ns.goodput_duration,
        "min_requests": ns.goodput_min_requests,
        "systems": {},
    }
    systems = goodput_systems(ns.gpus)
    chosen = ns.goodput_systems or list(systems)
    unknown = set(chosen) - set(systems)
    if unknown:
        out["error"] = f"unknown systems {sorted(unknown)} for {ns.gpus} GPUs: {list(systems)}"
        return out
    have = gpu_count() if ns.device == "cuda" else None
    # Time a system needs at least: its start (as long as the last one took) and a rate.
    need_s = 90.0
    for system in chosen:
        if have is not None and have < ns.gpus:
            out["systems"][system] = {"skipped": f"needs {ns.gpus} GPUs, found {have}"}
            continue
        if time.perf_counter() + need_s > deadline:
            out["systems"][system] = {"skipped": f"time budget (needs about {need_s:.0f} s)"}
            continue
        print(f"goodput {system} ({ns.gpus} GPUs)", flush=True)
        try:
            out["systems"][system] = run_system(
                system, systems[system], model, ns, workdir, deadline
            )
        except Exception as exc:  # noqa: BLE001 - recorded; the other systems still run
            out["systems"][system] = error_record(exc)
        need_s = max(need_s, out["systems"][system].get("startup_s", 0) + 60)
    return out
