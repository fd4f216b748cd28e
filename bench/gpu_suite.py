"""The GPU benchmark suite: every system side by side, in one run, on one machine.

Per model shape (random weights, bf16) and concurrency: a (transformers generate(),
static batches), b (the engine in-process), cc (one colocated worker behind the router),
c (1 prefill + 1 decode worker) and floor (b's decode step against the memory floor);
b, cc and c run bench.suite_common's closed loops, one-GPU parts run in bench.suite_offline
(a process per shape). Prints bench.suite_report's tables; writes one JSON to --out and
to $OUT/gpu_suite.json when $OUT is set.

    python -m bench.gpu_suite --quick                  # smoke: 1b, small runs
    python -m bench.gpu_suite --shapes 8b --parts b,c,floor
    python -m bench.gpu_suite --quick --shapes tiny --device cpu   # the suite itself, on CPU
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.report import device_out, int_list, provenance
from bench.suite_common import add_run_args, error_record, model_path, plan_from_args
from bench.suite_report import format_tables

ALL_PARTS = ("a", "b", "cc", "c", "floor")
OFFLINE_PARTS = {"a", "b", "floor"}
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
        "--rounds-at-c1", type=int, help="requests in turn at concurrency 1; default 12 (quick: 2)"
    )
    add_run_args(p, "b, cc and c", ttft_lens="512,2048")
    p.add_argument("--kv-cache-gib", help="per shape, e.g. 1b:8,8b:24 (each worker / engine)")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="per service start, s")
    p.add_argument("--serve-extra", default="", help="more `pdserve serve` flags (cc, c)")
    p.add_argument(
        "--client-processes",
        type=int,
        default=4,
        help="cc, c: client processes sharing each closed loop (one Python client reading "
        "128 streams of a small model is as busy as the router)",
    )
    p.add_argument("--offline-timeout", type=float, default=900.0, help="per shape, s")
    p.add_argument("--time-budget", type=float, help="s; parts past it are skipped (noted)")
    p.add_argument("--workdir", default="/tmp/pdserve-gpu-suite", help="logs, scratch")
    p.add_argument("--out", help=f"JSON path (default {DEFAULT_OUT})")
    ns = p.parse_args(argv)

    def pick(value: Any, full: Any, small: Any) -> Any:
        return value if value is not None else (small if ns.quick else full)

    ns.parts = [x for x in ns.parts.split(",") if x]
    unknown = set(ns.parts) - set(ALL_PARTS)
    if unknown:
        p.error(f"unknown parts {sorted(unknown)}; choose from {', '.join(ALL_PARTS)}")
    ns.shapes = pick(ns.shapes, "1b,8b", "1b").split(",")
    ns.concurrency = int_list(pick(ns.concurrency, "1,32,128", "1,8"))
    ns.output_len = pick(ns.output_len, 128, 32)
    ns.rounds_at_c1 = pick(ns.rounds_at_c1, 12, 2)
    ns.ttft_lens = int_list(ns.ttft_lens)
    if ns.rounds is not None and ns.rounds < 1:
        p.error("--rounds must be >= 1")
    ns.serve_extra = shlex.split(ns.serve_extra) + (["--no-compile"] if ns.no_compile else [])
    if ns.prompt_graph_max_tokens is not None:
        ns.serve_extra += ["--prompt-graph-max-tokens", str(ns.prompt_graph_max_tokens)]
    items = (item.partition(":") for item in (ns.kv_cache_gib or "").split(",") if item)
    ns.kv_cache_gib = {**DEFAULT_KV_GIB, **{name: float(gib) for name, _, gib in items}}
    return ns


# ---------------------------------------------------------------- parts


def run_offline(
    ns: argparse.Namespace, shape: str, model: Path, workdir: Path, timeout_s: float
) -> dict:
    """a, b, floor for one shape in a subprocess (bench.suite_offline)."""
    out = workdir / f"offline-{shape}.json"
    log = workdir / f"offline-{shape}.log"
    cmd = [
        sys.executable, "-m", "bench.suite_offline", f"--shape={shape}", f"--model={model}",
        f"--device={ns.device}", "--parts=" + ",".join(p for p in ns.parts if p in OFFLINE_PARTS),
        "--concurrency=" + ",".join(map(str, ns.concurrency)), f"--prompt-len={ns.prompt_len}",
        f"--output-len={ns.output_len}", f"--kv-cache-gib={ns.kv_cache_gib.get(shape, 8.0)}",
        f"--rounds-at-c1={ns.rounds_at_c1}", "--burst" if ns.burst else "--no-burst",
        "--ttft-lens=" + ",".join(map(str, ns.ttft_lens)),
        f"--copy-bytes={(1 << 30) if ns.device == 'cuda' else (64 << 20)}", f"--out={out}",
        *(["--no-compile"] if ns.no_compile else []),
    ]  # fmt: skip
    optional = {"rounds": ns.rounds, "prompt-graph-max-tokens": ns.prompt_graph_max_tokens}
    cmd += [f"--{flag}={value}" for flag, value in optional.items() if value is not None]
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


SERVICE_PARTS = (("cc", "colocated"), ("c", "service"))  # part, key in the shape's record


def run_service(
    ns: argparse.Namespace, part: str, shape: str, model: Path, workdir: Path
) -> dict[str, Any]:
    """cc or c on its own service."""
    from bench.suite_service import run_service_part

    try:
        return run_service_part(part, shape, model, workdir, ns, plan=plan_from_args(ns))
    except Exception as exc:  # noqa: BLE001 - recorded; the other parts still run
        return error_record(exc)


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    workdir = Path(ns.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    outs = [Path(ns.out) if ns.out else DEFAULT_OUT]
    env_out = device_out()
    if env_out and (env_out / "gpu_suite.json").resolve() != outs[0].resolve():
        outs.append(env_out / "gpu_suite.json")
    result: dict[str, Any] = {
        "provenance": provenance("bench.gpu_suite", argv),
        "config": {k: v for k, v in vars(ns).items() if k != "out"},
        "notes": [
            "random weights of the real shapes (load_format dummy, seeded); bf16 on CUDA",
            "a: one batch of `concurrency` requests; b, cc, c: closed loops of "
            "`rounds` x `concurrency` prompts, at most `concurrency` in flight (rounds 1: "
            "the same batch as a); at concurrency 1, `rounds_at_c1` requests in turn",
            "TTFT from submission (a: the batch start; b: queued in the engine; "
            "cc, c: the client's send) to the first token; "
            "TPOT = (last - first) / (tokens - 1); acc (accept_ms): cc, c: the client's "
            "send to the response headers, which the router sends as the call's handler "
            "starts (the wait to be taken in, before any work on the request)",
            "floor_ms = (weight bytes read + batch * context * KV bytes/token) / copy "
            "bandwidth (read+write bytes / s of a 1 GiB device-to-device copy)",
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
    for shape in ns.shapes:
        model = model_path(shape, workdir)
        rec: dict[str, Any] = result["shapes"].setdefault(shape, {})
        if parts & (OFFLINE_PARTS | {"cc", "c"}) and out_of_time(60):
            rec["skipped"] = "time budget"
            continue
        if parts & OFFLINE_PARTS:
            print(f"[{time.perf_counter() - t_start:6.0f}s] {shape}: one-GPU parts", flush=True)
            left = deadline - time.perf_counter()
            timeout = min(ns.offline_timeout, left)
            rec["offline"] = run_offline(ns, shape, model, workdir, timeout)
            save()
        for part, key in SERVICE_PARTS:
            if part not in parts:
                continue
            if out_of_time(45):
                rec[key] = {"skipped": "time budget"}
                continue
            print(f"[{time.perf_counter() - t_start:6.0f}s] {shape}: service {part}", flush=True)
            rec[key] = run_service(ns, part, shape, model, workdir)
            save()
    result["tables"] = format_tables(result)
    save()
    print(result["tables"])
    print(f"\nwrote {', '.join(map(str, outs))} in {result['elapsed_s']} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
