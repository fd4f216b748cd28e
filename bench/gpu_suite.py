"""The GPU benchmark suite: every system side by side, in one run, on one machine.

For each model shape (random weights of the real shape, bf16; prompts of random tokens,
greedy, EOS ignored) at each concurrency:

  a   transformers generate(), static batches, one GPU
  a2  transformers continuous batching (generate_batch, paged attention), one GPU
  b   pdserve colocated engine (engine.llm.LLM), one GPU
  c   pdserve 1 prefill + 1 decode worker over gRPC, two GPUs

reporting output tokens/s and TTFT / TPOT p50 and p99. Plus:

  floor    b's full-batch decode step vs the memory floor: (weight bytes + KV bytes read
           per step) / device-to-device copy bandwidth measured in the same run
  handoff  c's KV hand-off (timings.kv_transfer_seconds) for 512- and 2048-token prompts,
           GiB/s against raw dist.send of the same bytes (two processes, NCCL, same run)
  goodput  DistServe's measure: 2048-in / 128-out requests at increasing Poisson rates;
           the highest rate at which >= 90% meet TTFT <= 1 s and TPOT <= 50 ms, for 1P1D
           and for two colocated replicas behind the router (`--colocated-workers 2`)

One-GPU parts run in a subprocess per shape (bench.suite_offline) so memory is returned
between them; this process never touches CUDA. Prints tables; writes one JSON to --out
and to $OUT/gpu_suite.json when $OUT is set. Examples:

    python -m bench.gpu_suite                          # everything (~8 min on 2 H100)
    python -m bench.gpu_suite --quick                  # smoke: 1b, small runs
    python -m bench.gpu_suite --shapes 8b --parts b,c,floor
    python -m bench.gpu_suite --quick --shapes tiny --device cpu   # the suite itself, on CPU
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.suite_common import KVGeometry, error_record, shape_path

ALL_PARTS = ("a", "a2", "b", "c", "floor", "handoff", "goodput")
OFFLINE_PARTS = {"a", "a2", "b", "floor"}
DEFAULT_KV_GIB = {"1b": 8.0, "8b": 24.0, "tiny": 0.25}
DEFAULT_OUT = Path("bench/results/gpu_suite.json")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", help="comma list of 1b, 8b (tiny: CPU smoke); default 1b,8b")
    p.add_argument(
        "--parts", default=",".join(ALL_PARTS), help="comma list of " + ",".join(ALL_PARTS)
    )
    p.add_argument("--quick", action="store_true", help="small smoke run (defaults below shrink)")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run of the suite")
    p.add_argument("--concurrency", help="comma list; default 1,32,128 (quick: 1,8)")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, help="default 128 (quick: 32)")
    p.add_argument(
        "--rounds-at-c1",
        type=int,
        help="sequential requests at concurrency 1 for "
        "b and c (a, a2 run one); default 3 (quick: 2)",
    )
    p.add_argument("--kv-cache-gib", help="per shape, e.g. 1b:8,8b:24 (each worker / engine)")
    p.add_argument("--handoff-lens", default="512,2048")
    p.add_argument("--handoff-samples", type=int, help="default 5 (quick: 3)")
    p.add_argument("--goodput-shape", help="default 8b (quick: the first shape)")
    p.add_argument("--goodput-rates", help="req/s, increasing; default 2,4,8,16 (quick: 2,8)")
    p.add_argument("--goodput-duration", type=float, help="s of arrivals per rate; default 6")
    p.add_argument("--goodput-min-requests", type=int, help="per rate; default 12 (quick: 8)")
    p.add_argument("--goodput-prompt-len", type=int, default=2048)
    p.add_argument("--goodput-output-len", type=int, default=128)
    p.add_argument("--ttft-slo", type=float, default=1.0, help="seconds")
    p.add_argument("--tpot-slo", type=float, default=0.05, help="seconds per output token")
    p.add_argument("--attainment", type=float, default=0.9)
    p.add_argument("--startup-timeout", type=float, default=300.0, help="per service start, s")
    p.add_argument("--offline-timeout", type=float, default=900.0, help="per shape, s")
    p.add_argument(
        "--time-budget",
        type=float,
        help="s for the whole suite: parts that would start past it are skipped (noted in "
        "the JSON); goodput stops before a rate that would overrun it",
    )
    p.add_argument("--workdir", default="/tmp/pdserve-gpu-suite", help="logs, scratch")
    p.add_argument("--out", help=f"JSON path (default {DEFAULT_OUT})")
    ns = p.parse_args(argv)
    quick = ns.quick

    def pick(value: Any, full: Any, small: Any) -> Any:
        return value if value is not None else (small if quick else full)

    ns.parts = [x for x in ns.parts.split(",") if x]
    unknown = set(ns.parts) - set(ALL_PARTS)
    if unknown:
        p.error(f"unknown parts {sorted(unknown)}; choose from {', '.join(ALL_PARTS)}")
    ns.shapes = pick(ns.shapes, "1b,8b", "1b").split(",")
    ns.concurrency = [int(c) for c in pick(ns.concurrency, "1,32,128", "1,8").split(",")]
    ns.output_len = pick(ns.output_len, 128, 32)
    ns.rounds_at_c1 = pick(ns.rounds_at_c1, 3, 2)
    ns.handoff_lens = [int(x) for x in ns.handoff_lens.split(",")]
    ns.handoff_samples = pick(ns.handoff_samples, 5, 3)
    ns.goodput_shape = pick(ns.goodput_shape, "8b", ns.shapes[0])
    ns.goodput_rates = [float(r) for r in pick(ns.goodput_rates, "2,4,8,16", "2,8").split(",")]
    ns.goodput_duration = pick(ns.goodput_duration, 6.0, 3.0)
    ns.goodput_min_requests = pick(ns.goodput_min_requests, 12, 8)
    kv = dict(DEFAULT_KV_GIB)
    for item in (ns.kv_cache_gib or "").split(","):
        if item:
            name, _, gib = item.partition(":")
            kv[name] = float(gib)
    ns.kv_cache_gib = kv
    return ns


# ---------------------------------------------------------------- parts


def run_offline(
    ns: argparse.Namespace, shape: str, model: Path, workdir: Path, timeout_s: float
) -> dict:
    """a, a2, b, floor for one shape in a subprocess (bench.suite_offline)."""
    out = workdir / f"offline-{shape}.json"
    log = workdir / f"offline-{shape}.log"
    cmd = [
        sys.executable,
        "-m",
        "bench.suite_offline",
        f"--shape={shape}",
        f"--model={model}",
        f"--device={ns.device}",
        "--parts=" + ",".join(p for p in ns.parts if p in OFFLINE_PARTS),
        "--concurrency=" + ",".join(map(str, ns.concurrency)),
        f"--prompt-len={ns.prompt_len}",
        f"--output-len={ns.output_len}",
        f"--kv-cache-gib={ns.kv_cache_gib.get(shape, 8.0)}",
        f"--rounds-at-c1={ns.rounds_at_c1}",
        f"--copy-bytes={(1 << 30) if ns.device == 'cuda' else (64 << 20)}",
        f"--out={out}",
    ]
    start = time.perf_counter()
    with open(log, "wb") as f:
        try:
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s)
            code: int | str = proc.returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    result = json.loads(out.read_text()) if out.exists() else {}
    result["process"] = {"exit_code": code, "seconds": round(time.perf_counter() - start, 1)}
    if code != 0:
        result["process"]["log_tail"] = log.read_bytes()[-3000:].decode(errors="replace")
    return result


def kv_itemsize(ns: argparse.Namespace) -> int:
    """Bytes per KV element as the service runs: bf16 on CUDA, float32 on CPU."""
    return 2 if ns.device == "cuda" else 4


def run_nccl_raw(ns: argparse.Namespace, workdir: Path) -> dict:
    from bench.suite_nccl import send_bandwidth

    sizes = {
        KVGeometry.of(shape_path(s, workdir), kv_itemsize(ns)).handoff_bytes(n)
        for s in ns.shapes
        for n in ns.handoff_lens
    }
    if ns.device == "cuda":
        sizes.add(1 << 30)  # the link's peak, for reference
    return send_bandwidth(sorted(sizes), use_cuda=ns.device == "cuda")


def run_goodput_curves(ns: argparse.Namespace, workdir: Path, deadline: float) -> dict:
    from bench.suite_service import run_goodput, serve_help

    model = shape_path(ns.goodput_shape, workdir)
    kv = str(ns.kv_cache_gib.get(ns.goodput_shape, 8.0))
    common = ["--max-in-flight", "1024", "--max-queue", "4096", "--drain-grace-s", "10"]
    kwargs = dict(
        workdir=workdir,
        rates=ns.goodput_rates,
        duration_s=ns.goodput_duration,
        min_requests=ns.goodput_min_requests,
        prompt_len=ns.goodput_prompt_len,
        output_len=ns.goodput_output_len,
        ttft_slo_s=ns.ttft_slo,
        tpot_slo_s=ns.tpot_slo,
        attainment=ns.attainment,
        startup_timeout_s=ns.startup_timeout,
        deadline=deadline,
    )
    out: dict[str, Any] = {
        "shape": ns.goodput_shape,
        "slo": {"ttft_s": ns.ttft_slo, "tpot_s": ns.tpot_slo, "attainment": ns.attainment},
        "prompt_len": ns.goodput_prompt_len,
        "output_len": ns.goodput_output_len,
    }
    systems = {
        "1p1d": ["--prefill-kv-cache-gib", kv, "--decode-kv-cache-gib", kv, *common],
        "colocated_x2": ["--colocated-workers", "2", "--decode-kv-cache-gib", kv, *common],
    }
    has_colocated = "--colocated-workers" in serve_help()
    for system, args in systems.items():
        if system.startswith("colocated") and not has_colocated:
            out[system] = {"skipped": "`pdserve serve --colocated-workers` is not in this checkout"}
            continue
        if time.perf_counter() + 60 > deadline:
            out[system] = {"skipped": "time budget"}
            continue
        try:
            out[system] = run_goodput(system, args, model, **kwargs)  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001 - recorded; the other curve still runs
            out[system] = error_record(exc)
    return out


# ---------------------------------------------------------------- report


def _fmt(x: Any, nd: int = 1) -> str:
    if x is None or (isinstance(x, float) and x != x):
        return "-"
    return f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def _runs(section: Any) -> list[dict]:
    if isinstance(section, list):
        return section
    if isinstance(section, dict):
        return section.get("runs", [])
    return []


def format_tables(result: dict) -> str:
    lines = []
    head = f"{'shape':<6}{'system':<24}{'conc':>5}{'tok/s':>10}{'TTFT p50':>10}{'p99':>9}"
    head += f"{'TPOT p50':>10}{'p99':>9}{'ITL p50':>9}{'ok':>8}"
    lines += ["== throughput and latency (ms) ==", head]
    for shape, rec in result.get("shapes", {}).items():
        if rec.get("skipped"):
            lines.append(f"{shape:<6} skipped: {rec['skipped']}")
        off = rec.get("offline", {})
        sections = [off.get("a"), off.get("a2"), off.get("b"), rec.get("service")]
        for section in sections:
            for r in _runs(section):
                lines.append(
                    f"{shape:<6}{r['system']:<24}{r['concurrency']:>5}{_fmt(r['output_tok_s']):>10}"
                    f"{_fmt(r['ttft_ms']['p50']):>10}{_fmt(r['ttft_ms']['p99']):>9}"
                    f"{_fmt(r['tpot_ms']['p50'], 2):>10}{_fmt(r['tpot_ms']['p99'], 2):>9}"
                    f"{_fmt(r.get('itl_ms', {}).get('p50'), 2):>9}"
                    f"{r['num_ok']:>4}/{r['num_requests']:<3}"
                )
        for name, section in (("a", off.get("a")), ("a2", off.get("a2")), ("b", off.get("b"))):
            if isinstance(section, dict) and "error" in section:
                lines.append(f"{shape:<6}{name:<24} ERROR {section['error'][:100]}")
        svc = rec.get("service")
        if isinstance(svc, dict) and "error" in svc:
            lines.append(f"{shape:<6}{'c':<24} ERROR {svc['error'][:100]}")
    lines += ["", "== decode step vs memory floor (b, full-batch decode-only steps) =="]
    lines.append(
        f"{'shape':<6}{'batch':>6}{'step ms':>10}{'exec ms':>10}{'floor ms':>10}{'x floor':>9}"
    )
    for shape, rec in result.get("shapes", {}).items():
        b = rec.get("offline", {}).get("b")
        for r in _runs(b):
            d = r.get("decode_step", {})
            lines.append(
                f"{shape:<6}{r['concurrency']:>6}{_fmt(d.get('step_ms'), 2):>10}"
                f"{_fmt(d.get('execute_ms'), 2):>10}{_fmt(d.get('floor_ms'), 3):>10}"
                f"{_fmt(d.get('step_over_floor'), 1):>9}"
            )
        bw = rec.get("offline", {}).get("copy_bandwidth", {})
        if bw.get("read_write_gb_s"):
            lines.append(f"{shape:<6} copy bandwidth {bw['read_write_gb_s']} GB/s (read+write)")
    raw = {row["bytes"]: row for row in result.get("nccl_raw", {}).get("sizes", [])}
    lines += ["", "== KV hand-off vs raw dist.send (same bytes) =="]
    lines.append(
        f"{'shape':<6}{'prompt':>7}{'MiB':>8}{'ms p50':>9}{'GiB/s':>8}{'wire GiB/s':>11}"
        f"{'raw GiB/s':>11}{'ratio':>7}{'wire ratio':>11}"
    )
    for shape, rec in result.get("shapes", {}).items():
        svc = rec.get("service") or {}
        for h in svc.get("handoff", []) if isinstance(svc, dict) else []:
            r = raw.get(h["bytes"], {})
            ratio = h.get("gib_s_p50") / r["gib_s"] if r and h.get("gib_s_p50") else None
            wire = h.get("wire_gib_s_p50")
            wire_ratio = wire / r["gib_s"] if r and wire else None
            lines.append(
                f"{shape:<6}{h['prompt_len']:>7}{h['bytes'] / 2**20:>8.1f}"
                f"{_fmt((h.get('seconds_p50') or 0) * 1000, 2):>9}{_fmt(h.get('gib_s_p50')):>8}"
                f"{_fmt(wire):>11}{_fmt(r.get('gib_s')):>11}{_fmt(ratio, 2):>7}"
                f"{_fmt(wire_ratio, 2):>11}"
            )
    lines += [
        "",
        "== TPOT p50 / ITL p50 over b's full-batch decode step (same concurrency) ==",
        f"{'shape':<6}{'system':<24}{'conc':>5}{'step ms':>9}{'TPOT/step':>11}{'ITL/step':>10}"
        f"{'tok/msg':>9}",
    ]
    for shape, rec in result.get("shapes", {}).items():
        b_runs = {r["concurrency"]: r for r in _runs(rec.get("offline", {}).get("b"))}
        for r in [*b_runs.values(), *_runs(rec.get("service"))]:
            step = b_runs.get(r["concurrency"], {}).get("decode_step", {}).get("step_ms")
            if not step or r["concurrency"] == 1:
                continue
            itl = r.get("itl_ms", {}).get("p50")
            lines.append(
                f"{shape:<6}{r['system']:<24}{r['concurrency']:>5}{_fmt(step, 2):>9}"
                f"{_fmt(r['tpot_ms']['p50'] / step, 2):>11}"
                f"{_fmt(itl / step if itl else None, 2):>10}"
                f"{_fmt(r.get('tokens_per_message'), 2):>9}"
            )
    lines += ["", "== TTFT at concurrency 1: c (1P1D, gRPC) vs b (engine in-process), ms p50 =="]
    for shape, rec in result.get("shapes", {}).items():
        b = {r["concurrency"]: r for r in _runs(rec.get("offline", {}).get("b"))}.get(1)
        c = {r["concurrency"]: r for r in _runs(rec.get("service"))}.get(1)
        if b and c:
            lines.append(
                f"{shape:<6} c {_fmt(c['ttft_ms']['p50'], 2)}  b {_fmt(b['ttft_ms']['p50'], 2)}"
                f"  (+{_fmt(c['ttft_ms']['p50'] - b['ttft_ms']['p50'], 2)})"
            )
    gp = result.get("goodput")
    if gp:
        lines += [
            "",
            f"== goodput ({gp.get('shape')}, {gp.get('prompt_len')} in / "
            f"{gp.get('output_len')} out, SLO {gp.get('slo')}) ==",
        ]
        for system in ("1p1d", "colocated_x2"):
            rec = gp.get(system, {})
            if "points" not in rec:
                lines.append(f"{system:<14} {rec.get('skipped') or rec.get('error', '')[:120]}")
                continue
            lines.append(
                f"{system:<14} max rate meeting SLO: {rec.get('max_rate_meeting_slo')} req/s"
            )
            if rec.get("stopped"):
                lines.append(f"{'':<14} {rec['stopped']}")
            for pt in rec["points"]:
                lines.append(
                    f"{'':<14} rate {pt['rate']:>5}  attained {pt['slo_attainment']:.2f}  "
                    f"tok/s {_fmt(pt['output_tok_s'])}  TTFT p99 {_fmt(pt['ttft_ms']['p99'])}  "
                    f"TPOT p99 {_fmt(pt['tpot_ms']['p99'], 2)}  "
                    f"ok {pt['num_ok']}/{pt['num_requests']}"
                )
    return "\n".join(lines)


def machine_meta(ns: argparse.Namespace) -> dict[str, Any]:
    from bench.offline import git_commit

    meta: dict[str, Any] = {
        "argv": sys.argv[1:],
        "git_commit": git_commit(),
        "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if ns.device == "cuda" and shutil.which("nvidia-smi"):
        query = "--query-gpu=name,memory.total,driver_version"
        smi = subprocess.run(
            ["nvidia-smi", query, "--format=csv,noheader"], capture_output=True, text=True
        )
        meta["gpus"] = smi.stdout.strip().splitlines()
    try:
        import torch
        import transformers

        meta["torch"], meta["transformers"] = torch.__version__, transformers.__version__
    except ImportError:  # pragma: no cover
        pass
    return meta


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    workdir = Path(ns.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    outs = [Path(ns.out) if ns.out else DEFAULT_OUT]
    if os.environ.get("OUT"):
        outs.append(Path(os.environ["OUT"]) / "gpu_suite.json")
    result: dict[str, Any] = {
        "meta": machine_meta(ns),
        "config": {k: v for k, v in vars(ns).items() if k != "out"},
        "notes": [
            "random weights of the real shapes (load_format dummy, seeded); bf16 on CUDA",
            "a, a2: one batch of `concurrency` requests; b, c: that too, except "
            "`rounds_at_c1` sequential requests at concurrency 1",
            "TTFT from submission (a, b: the batch start; a2: request creation; c: the "
            "client's send) to the first token; TPOT = (last - first) / (tokens - 1)",
            "floor_ms = (weight bytes read + batch * context * KV bytes/token) / copy "
            "bandwidth (read+write bytes / s of a 1 GiB device-to-device copy)",
            "handoff bytes = whole blocks of the prompt * KV bytes/token; hand-off time "
            "= the prefill worker sending header + payload on the pair channel until the "
            "send completes (timings.kv_transfer_seconds)",
        ],
        "shapes": {},
    }
    t_start = time.perf_counter()
    deadline = t_start + (ns.time_budget or float("inf"))

    def out_of_time(needed_s: float) -> bool:
        return time.perf_counter() + needed_s > deadline

    def save() -> None:
        result["elapsed_s"] = round(time.perf_counter() - t_start, 1)
        for path in outs:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(result, indent=1))

    parts = set(ns.parts)
    if "handoff" in parts:
        try:
            result["nccl_raw"] = run_nccl_raw(ns, workdir)
        except Exception as exc:  # noqa: BLE001 - recorded; the rest still runs
            result["nccl_raw"] = error_record(exc)
        save()
    for shape in ns.shapes:
        model = shape_path(shape, workdir)
        rec: dict[str, Any] = result["shapes"].setdefault(shape, {})
        if (parts & OFFLINE_PARTS or parts & {"c", "handoff"}) and out_of_time(60):
            rec["skipped"] = "time budget"
            continue
        if parts & OFFLINE_PARTS:
            print(f"[{time.perf_counter() - t_start:6.0f}s] {shape}: one-GPU parts", flush=True)
            left = deadline - time.perf_counter()
            timeout = min(ns.offline_timeout, left)
            rec["offline"] = run_offline(ns, shape, model, workdir, timeout)
            save()
        if parts & {"c", "handoff"} and out_of_time(45):
            rec["service"] = {"skipped": "time budget"}
        elif parts & {"c", "handoff"}:
            from bench.suite_service import run_disaggregated

            print(f"[{time.perf_counter() - t_start:6.0f}s] {shape}: 1P1D service", flush=True)
            try:
                rec["service"] = run_disaggregated(
                    shape,
                    model,
                    workdir=workdir,
                    concurrency=ns.concurrency,
                    prompt_len=ns.prompt_len,
                    output_len=ns.output_len,
                    rounds_at_c1=ns.rounds_at_c1,
                    kv_cache_gib=ns.kv_cache_gib.get(shape, 8.0),
                    handoff_lens=ns.handoff_lens,
                    handoff_samples=ns.handoff_samples,
                    parts=parts,
                    startup_timeout_s=ns.startup_timeout,
                    kv_itemsize=kv_itemsize(ns),
                )
            except Exception as exc:  # noqa: BLE001
                rec["service"] = error_record(exc)
            save()
    if "goodput" in parts:
        print(f"[{time.perf_counter() - t_start:6.0f}s] goodput", flush=True)
        result["goodput"] = run_goodput_curves(ns, workdir, deadline)
        save()
    result["tables"] = format_tables(result)
    save()
    print(result["tables"])
    print(f"\nwrote {', '.join(map(str, outs))} in {result['elapsed_s']} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
