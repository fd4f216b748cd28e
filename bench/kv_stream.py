"""Layer-wise KV streaming against one message after the pass, on one 1P1D service each.

Two services in turn, the same in everything but `--kv-stream-min-tokens` (0: every
hand-off streams its KV layer by layer during the prefill pass; a huge value: none
does, the KV leaves in one message after the pass). Every prompt goes through a
hand-off (`--local-prefill-max-tokens 0`). For each prompt length, requests one at a
time (max_tokens 4), then a burst of `--burst` requests of the longest length at once:

  ttft        the first token (the prefill worker's reply; never waits for the KV)
  gap1        first token → second token: what the KV's arrival, the decode admission
              and one decode step add after the first token
  handoff     the final message's timings.kv_transfer_seconds: how long after the KV
              was ready (streamed: after the first token was sampled) it was in place

The ratio streamed ÷ whole of gap1 and handoff per length shows where streaming pays;
the crossover sets the default of `--kv-stream-min-tokens`. Prints a table; writes JSON.

    python -m bench.kv_stream --shape 8b --no-compile          # 2 GPUs
    python -m bench.kv_stream --device cpu --lens 64,256 --samples 3 --burst 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from bench.harness import ServiceProcess
from bench.report import distribution, provenance
from bench.suite_common import KVGeometry, ReqTiming, make_prompts, shape_path
from bench.suite_service import drive

MODES = {"streamed": "0", "whole": str(10**9)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="8b", help="1b, 8b or tiny (dummy weights)")
    p.add_argument("--model", help="a model folder instead of --shape (real weights)")
    p.add_argument("--device", default="auto", help="auto (GPUs when present) or cpu")
    p.add_argument("--lens", default="256,512,1024,2048,4096", help="prompt lengths")
    p.add_argument("--samples", type=int, default=8, help="requests one at a time per length")
    p.add_argument("--burst", type=int, default=32, help="requests at once, longest length")
    p.add_argument("--modes", default="streamed,whole")
    p.add_argument("--no-compile", action="store_true", help="services without torch.compile")
    p.add_argument("--kv-cache-gib", type=float, help="per pool (default: from free memory)")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/pdserve-kv-stream"))
    p.add_argument("--out", type=Path, default=Path("bench/results/kv_stream.json"))
    ns = p.parse_args(argv)
    ns.lens = sorted(int(x) for x in ns.lens.split(","))
    ns.modes = ns.modes.split(",")
    unknown = set(ns.modes) - set(MODES)
    if unknown:
        p.error(f"unknown modes {sorted(unknown)}; choose from {', '.join(MODES)}")
    return ns


def _stats(timings: list[ReqTiming]) -> dict[str, Any]:
    ok = [t for t in timings if t.ok]
    return {
        "num_ok": len(ok),
        "num_requests": len(timings),
        "errors": sorted({t.error for t in timings if not t.ok})[:3],
        "ttft_ms": distribution([t.ttft_s for t in ok if t.ttft_s is not None], scale=1000),
        "gap1_ms": distribution([t.gaps_s[0] for t in ok if t.gaps_s], scale=1000),
        "handoff_ms": distribution([t.kv_transfer_s for t in ok if t.kv_transfer_s], scale=1000),
        "wire_ms": distribution([t.kv_wire_s for t in ok if t.kv_wire_s], scale=1000),
    }


def run_mode(ns: argparse.Namespace, mode: str, model: Path) -> dict[str, Any]:
    args = [
        "--model",
        str(model),
        *(["--load-format", "dummy"] if ns.model is None else []),
        "--device",
        ns.device,
        "--local-prefill-max-tokens",
        "0",
        "--kv-stream-min-tokens",
        MODES[mode],
        "--stream-interval",  # one token a message: the first gap is the KV's arrival
        "1",
        "--decode-max-num-seqs",
        str(max(128, ns.burst)),
        "--max-in-flight",
        "1024",
        "--drain-grace-s",
        "10",
        *(["--no-compile"] if ns.no_compile else []),
    ]
    if ns.kv_cache_gib:
        kv = str(ns.kv_cache_gib)
        args += ["--prefill-kv-cache-gib", kv, "--decode-kv-cache-gib", kv]
    svc = ServiceProcess(args, ns.workdir / f"service-{mode}.log")
    out: dict[str, Any] = {"mode": mode, "args": args}
    try:
        out["startup_s"] = round(svc.wait_serving(900), 1)
        vocab = KVGeometry.of(model).vocab_size
        # Warm-up: every length once, and one burst.
        for n in ns.lens:
            asyncio.run(drive(svc.address, make_prompts(1, n, vocab, seed=n), 4, concurrency=1))
        warm = make_prompts(ns.burst, ns.lens[-1], vocab, seed=1)
        asyncio.run(drive(svc.address, warm, 4, concurrency=ns.burst))
        out["alone"] = {}
        for n in ns.lens:
            prompts = make_prompts(ns.samples, n, vocab, seed=1000 + n)
            timings, _ = asyncio.run(drive(svc.address, prompts, 4, concurrency=1))
            out["alone"][n] = _stats(timings)
        prompts = make_prompts(ns.burst, ns.lens[-1], vocab, seed=2)
        timings, wall = asyncio.run(drive(svc.address, prompts, 4, concurrency=ns.burst))
        out["burst"] = {"prompt_len": ns.lens[-1], "wall_s": round(wall, 3), **_stats(timings)}
    finally:
        out["exit_code"] = svc.stop()
        if out["exit_code"] != 0 or "startup_s" not in out:
            out["log_tail"] = svc.log_tail()
    return out


def _p50(record: dict[str, Any], key: str) -> float:
    return float(record[key]["p50"])


def format_table(result: dict[str, Any]) -> str:
    modes = result["modes"]
    lines = [
        f"{'tokens':>7} {'mode':>9} {'ttft p50':>9} {'gap1 p50':>9} {'handoff p50':>12}"
        f" {'wire p50':>9}  (ms)"
    ]

    def row(label: str, mode: str, rec: dict[str, Any]) -> str:
        return (
            f"{label:>7} {mode:>9} {_p50(rec, 'ttft_ms'):9.2f} {_p50(rec, 'gap1_ms'):9.2f}"
            f" {_p50(rec, 'handoff_ms'):12.2f} {_p50(rec, 'wire_ms'):9.2f}"
        )

    for n in result["lens"]:
        for mode, rec in modes.items():
            if "alone" in rec:
                lines.append(row(str(n), mode, rec["alone"][n]))
    for mode, rec in modes.items():
        if "burst" in rec:
            lines.append(row(f"burst{result['burst']}", mode, rec["burst"]))
    if {"streamed", "whole"} <= modes.keys() and all("alone" in r for r in modes.values()):
        s, w = modes["streamed"], modes["whole"]
        lines.append(
            "streamed ÷ whole, gap1 p50 per length: "
            + ", ".join(
                f"{n}: {_p50(s['alone'][n], 'gap1_ms') / _p50(w['alone'][n], 'gap1_ms'):.2f}"
                for n in result["lens"]
            )
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    ns.workdir.mkdir(parents=True, exist_ok=True)
    model = Path(ns.model) if ns.model else shape_path(ns.shape, ns.workdir)
    result: dict[str, Any] = {
        "provenance": provenance("bench.kv_stream", sys.argv[1:] if argv is None else argv),
        "shape": ns.model or ns.shape,
        "lens": ns.lens,
        "burst": ns.burst,
        "modes": {},
    }
    started = time.perf_counter()
    for mode in ns.modes:
        result["modes"][mode] = run_mode(ns, mode, model)
    result["wall_s"] = round(time.perf_counter() - started, 1)
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps(result, indent=1, default=str))
    print(format_table(result))
    failed = [m for m, r in result["modes"].items() if r.get("exit_code") or "alone" not in r]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
