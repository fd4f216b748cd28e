"""Tensor-parallel layouts of one model side by side, one service at a time in one run:
each layout's start to SERVING, and its time to first token at concurrency 1 per prompt
length, against the first layout (the baseline, e.g. a colocated worker of the same TP
size). For a disaggregated layout the difference is the hand-off the first token waits
for (the exposed transfer), and the router's timings give the hand-off itself.

    python -m bench.tp_layouts --model deploy/model_configs/llama-70b --load-format dummy \\
        --layouts colocated_tp2,1p1d_tp2_tp2 --out tp_layouts.json

Layouts as bench.goodput writes them, or `colocated_tpN` (one worker of N GPUs) and
`1p1d_tpP_tpD` (a prefill worker of P GPUs handing off to a decode worker of D GPUs);
every prompt of a disaggregated layout is handed off.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.goodput import Layout, Pool, parse_layout
from bench.harness import service_process
from bench.harness.streams import TimedStream
from bench.report import REPO, fmt, int_list, text_table, write_result


def layout_flags(name: str) -> list[str]:
    """`pdserve serve` flags of a layout name (ValueError for a name it cannot read)."""
    if m := re.fullmatch(r"colocated_tp(\d+)", name):
        layout = Layout(Pool(1, int(m[1])))
    elif m := re.fullmatch(r"1p1d_tp(\d+)_tp(\d+)", name):
        layout = Layout(Pool(1, int(m[1])), Pool(1, int(m[2])))
    else:
        layout = parse_layout(name)
    local = ["--local-prefill-max-tokens", "0"] if layout.disaggregated else []
    return [*layout.serve_flags(), *local]


async def _ttfts(
    address: str, prompt_len: int, rounds: int, vocab: int, max_tokens: int
) -> dict[str, Any]:
    rng = random.Random(prompt_len)
    ttfts, transfers = [], []
    for _ in range(rounds):
        prompt = [rng.randrange(1, vocab) for _ in range(prompt_len)]
        started, stream = time.monotonic(), TimedStream()
        result = await stream.run(
            address,
            prompt_token_ids=prompt,
            max_tokens=max_tokens,
            temperature=0.0,
            ignore_eos=True,
        )
        if result.outcome != "final:FINISH_REASON_LENGTH" or not stream.arrivals:
            raise RuntimeError(f"request of {prompt_len} tokens ended {result.outcome}")
        ttfts.append((stream.times[0] - started) * 1e3)
        if result.final is not None:
            transfers.append(result.final.timings.kv_transfer_seconds * 1e3)
    return {
        "ttft_ms": statistics.median(ttfts),
        "ttft_ms_all": ttfts,
        "kv_transfer_ms": statistics.median(transfers) if transfers else 0.0,
    }


def run_layout(name: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Start the layout's service, time it to SERVING, measure TTFT per prompt length."""
    flags = [*layout_flags(name), "--model", args.model, "--load-format", args.load_format]
    flags += args.serve_args
    print(f"[{time.strftime('%H:%M:%S')}] {name}: starting", flush=True)
    with service_process(flags, workdir / f"{name}.log") as svc:
        start_s = svc.wait_serving(args.start_timeout)
        print(f"[{time.strftime('%H:%M:%S')}] {name}: SERVING after {start_s:.1f} s", flush=True)
        by_len = {
            str(n): asyncio.run(_ttfts(svc.address, n, args.rounds, args.vocab, args.max_tokens))
            for n in args.prompt_lens
        }
    return {"layout": name, "start_s": start_s, "by_prompt_len": by_len}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.tp_layouts",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default=str(REPO / "deploy" / "model_configs" / "llama-70b"))
    p.add_argument("--load-format", default="dummy", choices=["auto", "dummy"])
    p.add_argument("--layouts", default="colocated_tp2,1p1d_tp2_tp2")
    p.add_argument("--prompt-lens", type=int_list, default=[512, 2048])
    p.add_argument("--rounds", type=int, default=5, help="requests per prompt length")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--vocab", type=int, default=128000, help="prompt token ids are below this")
    p.add_argument("--start-timeout", type=float, default=400.0)
    p.add_argument("--out", default="tp_layouts.json")
    p.add_argument("serve_args", nargs="*", help="more `pdserve serve` flags (after --)")
    args = p.parse_args(argv)
    layouts = [name for name in args.layouts.split(",") if name]
    for name in layouts:
        layout_flags(name)  # refuse a bad name before anything starts
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="tp-layouts-") as tmp:
        for name in layouts:
            try:
                results.append(run_layout(name, args, Path(tmp)))
            except Exception as exc:  # noqa: BLE001 - the next layout still runs
                print(f"{name}: {exc}", file=sys.stderr)
                results.append({"layout": name, "error": str(exc)[-2000:]})
            write_result(args.out, "bench.tp_layouts", argv, layouts=results)
    base = next((r for r in results if "error" not in r), None)
    rows: list[Any] = []
    for r in results:
        if "error" in r:
            rows.append(f"{r['layout']} error")
            continue
        cells: list[Any] = [r["layout"], r["start_s"]]
        for n in args.prompt_lens:
            row, ref = r["by_prompt_len"][str(n)], base["by_prompt_len"][str(n)]  # type: ignore[index]
            row["ttft_vs_base"] = row["ttft_ms"] / ref["ttft_ms"]
            row["exposed_ms"] = row["ttft_ms"] - ref["ttft_ms"]
            cells += [
                fmt(row[k], 2) for k in ("ttft_ms", "ttft_vs_base", "exposed_ms", "kv_transfer_ms")
            ]
        rows.append(cells)
    head = [h for n in args.prompt_lens for h in (f"TTFT@{n}", "÷base", "exposed", "KV ms")]
    print("\n".join(["", *text_table(["layout", "start s", *head], rows)]))
    write_result(args.out, "bench.tp_layouts", argv, layouts=results)
    print(f"wrote {args.out}")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
