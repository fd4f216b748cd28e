"""Goodput of serving layouts side by side, one service at a time on the same GPUs, in
one run: per layout and TPOT objective the highest Poisson rate sustained, then every
disaggregated layout ÷ the colocated layouts of as many GPUs (bench.goodput).

Each layout's service starts once and is gone, its GPUs free, before the next starts;
every layout gets the same prompts and arrival gaps at a rate. A disaggregated layout
runs one sweep per objective (`--aim per-slo`) with its router's local-prefill rule
aimed at it. The JSON is rewritten after each layout; `--report A.json B.json` prints the
tables of several runs merged. A CPU smoke run (about 2 minutes on 2 cores):

    python -m bench.tp_goodput --quick --out /tmp/tp_goodput_quick.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.goodput import (
    Layout,
    RateProbeSearch,
    attainment,
    comparisons,
    format_tables,
    give_up_when_missed,
    layout_bracket,
    looser_than,
    parse_layouts,
    slo_key,
)
from bench.report import write_result
from bench.suite_common import KVGeometry, error_record, make_prompts, summarize

# Seconds kept at the end of a layout's budget for its stop and the GPUs' release,
# until a stop has been timed (then the longest one so far and a margin).
STOP_RESERVE_S = 20.0
# A GPU counts as released when at most this much of its memory is in use.
GPU_FREE_MIB = 1024
# Flags whose default --quick shrinks: (default, --quick's default).
SCALED = {
    "layouts": (
        "colocated:2xtp2,disagg:1xtp2+1xtp2",
        "colocated:2xtp1,colocated:1xtp2,disagg:1xtp1+1xtp1",
    ),
    "model_config": ("deploy/model_configs/llama-70b", "tiny"),
    "slo_tpot_ms": ("25,50", "50,200"),
    "slo_ttft_ms": (1000.0, 2000.0),
    "prompt_len": (2048, 64),
    "output_len": (128, 16),
    "start_rate": (2.0, 4.0),
    "max_probes": (5, 2),
    "probe_s": (15.0, 3.0),
    "min_requests": (12, 6),
}
QUICK_LAYOUTS = SCALED["layouts"][1]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.tp_goodput",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Defaults in [brackets] are --quick's.",
    )

    def scaled(flag: str, help: str, **kw: Any) -> None:
        full, small = SCALED[flag.removeprefix("--").replace("-", "_")]
        p.add_argument(flag, help=f"{help} (default {full} [{small}])", **kw)

    p.add_argument("--quick", action="store_true", help="a short CPU-sized run (see below)")
    scaled("--layouts", "comma list")
    scaled(
        "--model-config",
        "model folder (config.json), or a shape of bench.suite_common: 1b, 8b, tiny",
    )
    p.add_argument("--load-format", default="dummy", choices=["auto", "dummy"])
    scaled("--slo-tpot-ms", "TPOT objectives, comma list")
    scaled("--slo-ttft-ms", "TTFT objective", type=float)
    p.add_argument("--attainment", type=float, default=0.9, help="share of requests meeting it")
    scaled("--prompt-len", "tokens", type=int)
    scaled("--output-len", "tokens", type=int)
    scaled("--start-rate", "req/s of the first probe", type=float)
    p.add_argument("--min-rate", type=float, default=0.25, help="req/s; below: goodput 0")
    p.add_argument("--max-rate", type=float, default=256.0, help="req/s")
    p.add_argument(
        "--rates", help="comma list of req/s: probe only these (default: any rate the search picks)"
    )
    p.add_argument("--resolution", type=float, default=1.2, help="stop at failed/sustained <= this")
    scaled("--max-probes", "per sweep", type=int)
    scaled("--probe-s", "seconds of arrivals per probe", type=float)
    scaled("--min-requests", "per probe", type=int)
    p.add_argument(
        "--aim",
        choices=("per-slo", "tightest", "router-default"),
        default="per-slo",
        help="disaggregated layouts: one sweep per objective, the router aimed at it "
        "(per-slo); one sweep aimed at the tightest (tightest); one at the router's "
        "defaults (router-default)",
    )
    p.add_argument("--budget-s", type=float, help="seconds for the whole run (default: none)")
    p.add_argument("--layout-budget-s", type=float, help="seconds per layout, start to stop")
    p.add_argument("--start-timeout", type=float, default=400.0, help="per service start, s")
    p.add_argument(
        "--kv-cache-gib",
        type=float,
        help="per worker (default: on GPUs each worker sizes its cache from free memory; "
        "on CPU 0.25)",
    )
    p.add_argument("--max-num-seqs", type=int, default=256, help="decode / colocated workers")
    p.add_argument("--serve-extra", default="", help="more `pdserve serve` flags, one string")
    p.add_argument("--workdir", help="service logs (default $OUT/tp_goodput_logs, else a temp dir)")
    p.add_argument("--out", help="JSON (default $OUT/tp_goodput.json, else tp_goodput.json)")
    p.add_argument(
        "--report",
        nargs="+",
        metavar="JSON",
        help="run nothing: print the tables of these runs' layouts, merged (later files win)",
    )
    ns = p.parse_args(argv)
    for name, (full, small) in SCALED.items():
        if getattr(ns, name) is None:
            setattr(ns, name, small if ns.quick else full)
    ns.serve_extra = shlex.split(ns.serve_extra)
    try:
        ns.layouts = parse_layouts(ns.layouts)
        ns.slos = sorted({float(x) for x in ns.slo_tpot_ms.split(",") if x})
        ns.rates = tuple(sorted(float(x) for x in (ns.rates or "").split(",") if x))
    except ValueError as exc:
        p.error(str(exc))
    if not ns.slos:
        p.error("--slo-tpot-ms needs at least one objective")
    if not 0 < ns.attainment <= 1:
        p.error("--attainment must be in (0, 1]")
    return ns


# ---------------------------------------------------------------- one layout


def run_point(
    address: str, geo: KVGeometry, ns: argparse.Namespace, rate: float, tpot_ms: float, sweep: int
) -> dict[str, Any]:
    """One probe: Poisson arrivals of the same prompts and gaps for every layout (the
    `sweep`-th of one service gets prompts of its own: none found in its cache); cut
    short once the misses at `tpot_ms` (the objective it is aimed at) are past saving."""
    from bench.suite_service import drive

    n = max(ns.min_requests, round(rate * ns.probe_s))
    seed = int(rate * 1000) + 7 + 1_000_003 * sweep
    prompts = make_prompts(n, ns.prompt_len, geo.vocab_size, seed=seed)
    give_up = give_up_when_missed(
        n, ns.attainment, ns.slo_ttft_ms / 1000, tpot_ms / 1000, ns.output_len
    )
    timeout_s = max(120.0, 4 * n / rate)
    timings, wall = asyncio.run(
        drive(
            address,
            prompts,
            ns.output_len,
            rate=rate,
            seed=int(rate * 100),
            give_up=give_up,
            timeout_s=timeout_s,
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
    met = {slo_key(slo): round(attainment(requests, ns.slo_ttft_ms, slo), 4) for slo in ns.slos}
    gave_up = any(t.error.endswith("gave up") for t in timings)
    point = summarize("", 0, timings, wall, rate=rate, attainment=met, gave_up=gave_up)
    del point["system"], point["concurrency"]
    return {**point, "settle_s": asyncio.run(settle(address)), "requests": requests}


async def settle(address: str, timeout_s: float = 60.0) -> float:
    """Seconds until the router and every worker hold nothing (after cancelled calls)."""
    from router.cli.client import get_pool_stats

    start = time.perf_counter()
    while time.perf_counter() - start < timeout_s:
        stats = await get_pool_stats(address)
        busy = stats.num_in_flight or stats.num_queued
        if not (busy or any(w.num_running or w.num_waiting for w in stats.workers)):
            break
        await asyncio.sleep(0.2)
    return round(time.perf_counter() - start, 2)


async def aim_router(address: str, tpot_ms: float, ttft_ms: float) -> None:
    """The router's local-prefill rule aimed at these targets from now on."""
    from pdserve.v1 import admin_pb2
    from router.cli.admin_client import set_prefill_policy

    request = admin_pb2.SetPrefillPolicyRequest(slo_tpot_ms=tpot_ms, slo_ttft_ms=ttft_ms)
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


def sweeps(layout: Layout, aim: str, slos: list[float]) -> list[tuple[float | None, list[str]]]:
    """A layout's sweeps: the TPOT target its router is aimed at (None: left as
    started) and the objectives the sweep is scored at."""
    keys = [slo_key(s) for s in slos]
    if not layout.disaggregated or aim == "router-default":
        return [(None, keys)]
    if aim == "tightest":
        return [(slos[0], keys)]
    return [(s, [slo_key(s)]) for s in slos]


def seed_rates(
    earlier: list[dict[str, Any]], points: list[dict[str, Any]], keys: list[str], target: float
) -> dict[str, float]:
    """Per objective, a first rate near the answer: the best goodput an earlier layout
    reached, or what this layout's earlier sweeps sustained at it."""
    seeds: dict[str, float] = {}
    for key in keys:
        known = [r["goodput"][key]["sustained"] for r in earlier if key in r.get("goodput", {})]
        own = [{**p, "counts_for": [key]} for p in points]
        known.append(layout_bracket(own, key, target).sustained)
        if max(known, default=0.0) > 0:
            seeds[key] = max(known)
    return seeds


def run_sweep(
    address: str,
    geo: Any,
    ns: argparse.Namespace,
    keys: list[str],
    seeds: dict[str, float],
    sweep: int,
    deadline: float,
    label: str,
    points: list[dict[str, Any]],
) -> str | None:
    """Probes of one sweep until its brackets are narrow or its time is spent, each
    point added to `points`; why it stopped early, if it did."""
    search = RateProbeSearch(
        keys=tuple(keys),
        start={k: seeds.get(k, ns.start_rate) for k in keys},
        growth=1.5 if seeds else 2.0,
        resolution=ns.resolution,
        min_rate=ns.min_rate,
        max_rate=ns.max_rate,
        max_probes=ns.max_probes,
        grid=ns.rates,
    )
    results: dict[float, dict[str, bool | None]] = {}
    while (probe := search.next_probe(results)) is not None:
        rate, tpot_ms = probe.rate, float(probe.aim)
        n = max(ns.min_requests, round(rate * ns.probe_s))
        # Arrivals, the last request's answer at the objective, the drain after it.
        need = n / rate + ns.slo_ttft_ms / 1000 + ns.output_len * tpot_ms / 1000 + 3
        if time.perf_counter() + need > deadline:
            return f"time budget: rate {rate:g} (about {need:.0f} s) not run"
        print(f"  {label}: {rate:g} req/s, {n} requests, at TPOT {probe.aim} ms", flush=True)
        point = run_point(address, geo, ns, rate, tpot_ms, sweep)
        point["probe_aim_tpot_ms"] = tpot_ms
        point["counts_for"] = keys
        if point["gave_up"]:  # the looser objectives saw an incomplete run
            for key in looser_than(probe.aim, point["attainment"]):
                point["attainment"][key] = None
        points.append(point)
        met = point["attainment"]
        results[rate] = {k: None if met[k] is None else met[k] >= ns.attainment for k in keys}
        print(f"    attainment {met}, {point['num_ok']}/{point['num_requests']} ok", flush=True)
        failed = [e for e in point["errors"] if not e.endswith("gave up")]
        if failed and point["num_ok"] == 0:
            return f"every request failed at {rate:g} req/s: {failed[0]}"
    return None


def run_layout(
    layout: Layout,
    ns: argparse.Namespace,
    model: Path,
    workdir: Path,
    deadline: float,
    earlier: list[dict[str, Any]],
) -> dict[str, Any]:
    """Start the layout's service, run its sweeps, stop it and wait for its GPUs, all
    by `deadline` (the earlier layouts' records seed the search and time the stop)."""
    from bench.harness.processes import process_tree
    from bench.suite_service import Service, check_warm_up, drive, service_args

    plan = sweeps(layout, ns.aim, ns.slos)
    stops = [r["stop_s"] for r in earlier if "stop_s" in r]
    reserve = max(stops) + 5 if stops else STOP_RESERVE_S
    args = service_args(
        model, layout.serve_flags(), layout.disaggregated, ns.kv_cache_gib, ns.max_num_seqs,
        drain_grace_s=5, load_format=ns.load_format,
    )  # fmt: skip
    if any(aim is not None for aim, _ in plan):
        args += ["--enable-admin"]
    slug = layout.name.replace(":", "-").replace("+", "-")
    record: dict[str, Any] = {**layout_record(layout), "points": [], "sweeps": []}
    started = time.perf_counter()
    svc = Service([*args, *ns.serve_extra], workdir / f"service-{slug}.log")
    record["args"] = svc.args
    try:
        timeout = min(ns.start_timeout, deadline - time.perf_counter() - reserve)
        record["startup_s"] = round(svc.wait_serving(max(timeout, 1.0)), 1)
        print(f"  {layout}: SERVING after {record['startup_s']} s", flush=True)
        record["on_gpus"] = "on GPUs" in svc.log_path.read_text(errors="replace")
        geo = KVGeometry.of(model)
        workers = layout.first.workers + (layout.decode.workers if layout.decode else 0)
        warm = make_prompts(2 * workers, ns.prompt_len, geo.vocab_size, seed=96)
        check_warm_up(asyncio.run(drive(svc.address, warm, 4, concurrency=len(warm)))[0])
        record["warm_settle_s"] = asyncio.run(settle(svc.address))
        record["workers"] = asyncio.run(worker_blocks(svc.address))
        for index, (aim, keys) in enumerate(plan):
            # The time left is shared evenly by the sweeps left.
            left = deadline - reserve - time.perf_counter()
            sweep_deadline = time.perf_counter() + left / (len(plan) - index)
            if aim is not None:
                asyncio.run(aim_router(svc.address, aim, ns.slo_ttft_ms))
            seeds = seed_rates(earlier, record["points"], keys, ns.attainment)
            label = layout.name + ("" if aim is None else f" aimed at {aim:g} ms")
            count = len(record["points"])
            stopped = run_sweep(
                svc.address, geo, ns, keys, seeds, index, sweep_deadline, label, record["points"]
            )
            for point in record["points"][count:]:
                point["aimed_tpot_ms"] = aim
            record["sweeps"].append({"aim_tpot_ms": aim, "scored": keys, "stopped": stopped})
    except Exception as exc:  # noqa: BLE001 - recorded with what was measured before it
        print(f"  {layout}: {exc}", file=sys.stderr, flush=True)
        record.update(error_record(exc))
    finally:
        stopping = time.perf_counter()
        tree = process_tree(svc.proc.pid)
        record["exit_code"] = svc.stop()
        record["release"] = release(tree, on_cuda=ns.on_cuda)
        record["stop_s"] = round(time.perf_counter() - stopping, 1)
        record["elapsed_s"] = round(time.perf_counter() - started, 1)
        if record["exit_code"] != 0 or "error" in record:
            record["log_tail"] = svc.log_tail()
    # Per objective: the bracket, and how many probes speak for it.
    record["goodput"] = {}
    for key in map(slo_key, ns.slos):
        counted = [p for p in record["points"] if key in p.get("counts_for", ())]
        if counted:
            b = layout_bracket(counted, key, ns.attainment)
            record["goodput"][key] = {
                "sustained": b.sustained,
                "failed": b.failed,
                "probes": len(counted),
            }
    return record


def layout_record(layout: Layout) -> dict[str, Any]:
    return {"layout": layout.name, "gpus": layout.gpus, "disaggregated": layout.disaggregated}


# ---------------------------------------------------------------- between layouts


def gpu_memory_used_mib() -> list[int]:
    """Memory in use on each GPU (nvidia-smi); [] without nvidia-smi."""
    query = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=30)
    except OSError:
        return []
    return [int(x) for x in out.stdout.split() if x.strip().isdigit()]


def release(pids: set[int], *, on_cuda: bool, timeout_s: float = 30.0) -> dict[str, Any]:
    """Wait until every process of a stopped service has exited (those still there
    after `timeout_s` are killed, each by its id) and, on GPUs, until their memory is
    free: the next layout starts on empty GPUs."""
    from bench.harness.processes import process_alive

    start = time.perf_counter()
    alive = {pid for pid in pids if process_alive(pid)}
    while alive and time.perf_counter() - start < timeout_s:
        time.sleep(0.2)
        alive = {pid for pid in alive if process_alive(pid)}
    for pid in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    out: dict[str, Any] = {"processes": len(pids), "processes_killed": len(alive)}
    if on_cuda:
        used = gpu_memory_used_mib()
        while used and max(used) > GPU_FREE_MIB and time.perf_counter() - start < 2 * timeout_s:
            time.sleep(0.5)
            used = gpu_memory_used_mib()
        out["gpu_mib_used"] = used
        out["gpus_free"] = bool(used) and max(used) <= GPU_FREE_MIB
    out["after_s"] = round(time.perf_counter() - start, 1)
    return out


# ---------------------------------------------------------------- the run


def report(paths: list[str]) -> int:
    """Tables of earlier runs' layouts, merged by name (a later file's record wins)."""
    records: dict[str, dict[str, Any]] = {}
    slos: set[float] = set()
    for path in paths:
        data = json.loads(Path(path).read_text())
        slos.update(data["config"]["slos"])
        records.update({r["layout"]: r for r in data["layouts"]})
    keys = [slo_key(s) for s in sorted(slos)]
    merged = list(records.values())
    print(format_tables(merged, keys, comparisons(merged, keys)))
    return 0


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    if ns.report:
        return report(ns.report)
    from bench.report import device_out, gpus
    from bench.suite_common import model_path

    env_out = device_out()
    out = Path(ns.out or (env_out or Path(".")) / "tp_goodput.json")
    logs = env_out / "tp_goodput_logs" if env_out else None
    workdir = Path(ns.workdir or logs or tempfile.mkdtemp(prefix="tp-goodput-"))
    workdir.mkdir(parents=True, exist_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    model = model_path(ns.model_config, workdir)
    have = len(gpus())
    ns.on_cuda = have > 0
    if ns.kv_cache_gib is None and not ns.on_cuda:
        ns.kv_cache_gib = 0.25
    keys = [slo_key(s) for s in ns.slos]
    config = {k: v for k, v in vars(ns).items() if k not in {"layouts", "report", "slo_tpot_ms"}}
    config.update(layouts=[x.name for x in ns.layouts], model=str(model), rates=list(ns.rates))
    where = f"{have} GPUs" if have else "CPU"
    print(f"{len(ns.layouts)} layouts of {model.name} on {where}; logs in {workdir}", flush=True)
    t0 = time.perf_counter()
    run_deadline = t0 + (ns.budget_s if ns.budget_s is not None else float("inf"))
    records: list[dict[str, Any]] = []

    def save(**extra: Any) -> None:
        elapsed = round(time.perf_counter() - t0, 1)
        write_result(
            out, "bench.tp_goodput", argv, config=config, elapsed_s=elapsed,
            layouts=records, comparisons=comparisons(records, keys), **extra,
        )  # fmt: skip

    for index, layout in enumerate(ns.layouts):
        now = time.perf_counter()
        share = (run_deadline - now) / (len(ns.layouts) - index)
        deadline = min(run_deadline, now + (ns.layout_budget_s or share))
        # A start as long as the longest so far, a warm-up, one probe and the stop.
        need = max((r.get("startup_s", 0.0) for r in records), default=30.0) + 40
        if ns.on_cuda and have < layout.gpus:
            records.append(
                {**layout_record(layout), "skipped": f"needs {layout.gpus} GPUs, found {have}"}
            )
        elif deadline - now < need:
            records.append(
                {**layout_record(layout), "skipped": f"time budget ({deadline - now:.0f} s left)"}
            )
        else:
            print(f"[{now - t0:5.0f}s] {layout} ({layout.gpus} GPUs)", flush=True)
            try:
                records.append(run_layout(layout, ns, model, workdir, deadline, records))
            except Exception as exc:  # noqa: BLE001 - recorded; the next layout still runs
                print(f"  {layout}: {exc}", file=sys.stderr, flush=True)
                records.append({**layout_record(layout), **error_record(exc)})
        save()
    tables = format_tables(records, keys, comparisons(records, keys))
    save(tables=tables)
    print(f"\n{tables}\n\nwrote {out} in {time.perf_counter() - t0:.0f} s", flush=True)
    return 0 if all(r.get("goodput") for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
