"""A worker's start on a fresh node and on a node that ran the model before.

    python -m bench.worker_start --out start.json                  # CPU, the embedded model
    python -m bench.worker_start --out start.json \\
        --serve-args "--model deploy/model_configs/llama-3.1-8b --load-format dummy"   # GPU

Starts `pdserve serve --colocated-workers 1` once per run (`--runs`, default
`fresh,warm`), one after the other, and stops it after each. Every run points the
compile caches (`TORCHINDUCTOR_CACHE_DIR`, `TRITON_CACHE_DIR`) into one directory for the
whole invocation (`--cache-dir`, default a new temporary one): a `fresh` run empties
them first, as on a node that never ran the model; a `warm` run finds them as the runs
before it left them, as on a node that did. The caches reach the worker through the
environment of the local Ray the service starts (not with `--ray-address`).

For each run: the seconds from launching the process to health SERVING, and the
worker's start-up phases (weights, kv_cache, compile, cuda_graphs, and engine, their
whole) from its `start-up: NAME SECONDS s` lines in the service's log. Prints a table
against the targets (engine and SERVING: warm within 45 s, fresh within 120 s) and
writes it, with provenance, as JSON. A run that does not reach SERVING is recorded with
its error and log tail, and the next run still goes; the exit status is 1 if any did not.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness.service import service_process
from bench.report import provenance

RUN_KINDS = ("fresh", "warm")
TARGETS_S = {"warm": 45.0, "fresh": 120.0}  # engine phase and SERVING, each
PHASES = ("weights", "kv_cache", "compile", "cuda_graphs")  # table columns after engine
CACHE_SUBDIRS = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}
STARTUP_LINE = re.compile(r"start-up: (\w+) (\d+(?:\.\d+)?) s\b")
LINES_WAIT_S = 15.0  # for the worker's lines to reach the log after SERVING


def parse_startup_phases(log_text: str) -> dict[str, float]:
    """Phase name → seconds, from every `start-up: NAME SECONDS s` in `log_text`; the
    last one wins where a name comes more than once."""
    return {m.group(1): float(m.group(2)) for m in STARTUP_LINE.finditer(log_text)}


def parse_runs(text: str) -> list[str]:
    runs = [r.strip() for r in text.split(",") if r.strip()]
    unknown = [r for r in runs if r not in RUN_KINDS]
    if not runs or unknown:
        raise argparse.ArgumentTypeError(
            f"runs are a comma-separated list of {', '.join(RUN_KINDS)}; got {text!r}"
        )
    return runs


def cache_env(cache_dir: Path) -> dict[str, str]:
    """The service's environment additions: every compile cache under `cache_dir`."""
    return {var: str(cache_dir / sub) for var, sub in CACHE_SUBDIRS.items()}


def empty_caches(cache_dir: Path) -> None:
    """Remove the compile caches under `cache_dir` (nothing else there)."""
    for sub in CACHE_SUBDIRS.values():
        shutil.rmtree(cache_dir / sub, ignore_errors=True)
    cache_dir.mkdir(parents=True, exist_ok=True)


def wait_for_engine_line(log_path: Path, timeout: float) -> None:
    """Wait until the log holds the worker's `engine` phase (Ray forwards a worker's
    output to the service's log a little after the worker wrote it), or `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log_path.read_bytes().decode(errors="replace")
        if "engine" in parse_startup_phases(text):
            return
        time.sleep(0.2)


def describe_failure(exc: BaseException, log_tail: str) -> str:
    """One line: the exception's first line and the log's last (its likely cause)."""
    first = next(iter(str(exc).splitlines()), "").rstrip(":")
    last = next((ln.strip() for ln in reversed(log_tail.splitlines()) if ln.strip()), "")
    return f"{type(exc).__name__}: {first}" + (f" -- {last}" if last else "")


def start_once(kind: str, serve_args: list[str], cache_dir: Path, timeout: float) -> dict[str, Any]:
    """One run: start the service, time it to SERVING, stop it, read its phases."""
    if kind == "fresh":
        empty_caches(cache_dir)
    log = Path(tempfile.mkstemp(prefix=f"worker-start-{kind}-", suffix=".log")[1])
    print(f"{kind}: starting (service log: {log})", flush=True)
    result: dict[str, Any] = {"run": kind, "log": str(log), "to_serving_s": None}
    start = time.perf_counter()
    try:
        with service_process(serve_args, log, env=cache_env(cache_dir)) as svc:
            svc.wait_serving(timeout)
            result["to_serving_s"] = time.perf_counter() - start
            wait_for_engine_line(log, LINES_WAIT_S)
    except Exception as exc:  # a failed run is recorded, and the next one still goes
        result["log_tail"] = log.read_bytes()[-4000:].decode(errors="replace")
        result["error"] = describe_failure(exc, result["log_tail"])
        print(f"{kind}: {result['error']}", flush=True)
    result["phases_s"] = parse_startup_phases(log.read_bytes().decode(errors="replace"))
    return result


def within_target(run: dict[str, Any]) -> bool | None:
    """Whether SERVING and the engine phase both came within the run's target; None
    where either was not measured."""
    serving, engine = run["to_serving_s"], run["phases_s"].get("engine")
    if serving is None or engine is None:
        return None
    target = TARGETS_S[run["run"]]
    return serving <= target and engine <= target


def fmt(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.2f}"


def table(runs: list[dict[str, Any]]) -> str:
    header = ["run", "to SERVING (s)", "engine (s)", *PHASES, "within target"]
    rows = [
        [
            r["run"],
            fmt(r["to_serving_s"]),
            fmt(r["phases_s"].get("engine")),
            *(fmt(r["phases_s"].get(p)) for p in PHASES),
            {True: "yes", False: "NO", None: "-"}[within_target(r)],
        ]
        for r in runs
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    rule = "-+-".join("-" * w for w in widths)
    return "\n".join([line(header), rule, *(line(row) for row in rows)])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.worker_start", description=__doc__.split("\n")[0]
    )
    p.add_argument("--serve-args", default="", help="more `pdserve serve` flags")
    p.add_argument("--runs", type=parse_runs, default=list(RUN_KINDS), help="e.g. fresh,warm")
    p.add_argument("--start-timeout-s", type=float, default=900.0, help="per run, to SERVING")
    p.add_argument(
        "--cache-dir", help="where the compile caches go (default: a new temporary directory)"
    )
    p.add_argument("--out", help="write the results as JSON here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    serve_args = ["--colocated-workers", "1", *shlex.split(args.serve_args)]
    cache_dir = Path(args.cache_dir or tempfile.mkdtemp(prefix="worker-start-cache-"))
    print(f"compile caches: {cache_dir}", flush=True)
    runs = [start_once(kind, serve_args, cache_dir, args.start_timeout_s) for kind in args.runs]
    print()
    print(table(runs))
    print(
        "targets (engine and to SERVING): "
        + ", ".join(f"{kind} <= {s:g} s" for kind, s in TARGETS_S.items())
    )
    summary = {
        "runs": [{**r, "within_target": within_target(r)} for r in runs],
        "targets_s": TARGETS_S,
        "serve_args": serve_args,
        "cache_dir": str(cache_dir),
        "provenance": provenance("bench.worker_start", sys.argv[1:] if argv is None else argv),
    }
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))
    return 0 if all(r["to_serving_s"] is not None for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
