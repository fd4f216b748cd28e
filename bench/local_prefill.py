"""Where does a hand-off stop paying? TTFT of the remote path (prefill pool + KV hand-off)
against the local path (the decode worker runs the prompt itself), by prompt length.

Two 1P1D services in turn, identical but for `--local-prefill-max-tokens` (0: always hand
off; a huge value: never). Sequential requests (concurrency 1), fresh random prompts (no
prefix-cache hits), a few output tokens. The shortest length at which the remote path's
TTFT p50 is no worse than the local one's suggests the default for
`--local-prefill-max-tokens` on that hardware. Prints a table; writes JSON.

    python -m bench.local_prefill                                  # CPU, embedded model
    python -m bench.local_prefill --serve-args "--model deploy/model_configs/llama-3.2-1b \\
        --load-format dummy" --lengths 32,128,512,2048             # GPUs
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness import ServiceProcess
from bench.report import percentile, write_result
from router.cli.client import stream_generate

NEVER = 1_000_000


async def _ttft(address: str, prompt: list[int], max_tokens: int) -> float:
    start = time.perf_counter()
    first = None
    async for resp in stream_generate(
        address, prompt_token_ids=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True
    ):
        if first is None and resp.token_ids:
            first = time.perf_counter() - start
    assert first is not None
    return first


def measure(
    threshold: int, args: argparse.Namespace, lengths: list[int], log_dir: Path
) -> dict[int, float]:
    flags = [*shlex.split(args.serve_args), "--local-prefill-max-tokens", str(threshold)]
    svc = ServiceProcess(flags, log_dir / f"service-threshold-{threshold}.log")
    rng = random.Random(0)
    try:
        svc.wait_serving(600)
        out = {}
        for length in lengths:
            samples = []
            for i in range(args.samples + 1):
                prompt = [rng.randrange(1000, 20000) for _ in range(length)]
                ttft = asyncio.run(_ttft(svc.address, prompt, args.output_len))
                if i:  # the first of each length warms that shape up
                    samples.append(ttft)
            out[length] = percentile(samples, 50)
        return out
    finally:
        svc.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--lengths", default="8,16,32,64,128,256")
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--output-len", type=int, default=4)
    parser.add_argument(
        "--serve-args",
        default="--prefill-kv-cache-gib 0.2 --decode-kv-cache-gib 0.2",
        help="extra `pdserve serve` flags for both services",
    )
    parser.add_argument(
        "--out", default=os.path.join(os.environ.get("OUT", "."), "local_prefill.json")
    )
    args = parser.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        remote = measure(0, args, lengths, Path(tmp))
        local = measure(NEVER, args, lengths, Path(tmp))
    rows: list[dict[str, Any]] = []
    print(f"{'prompt':>7} {'remote TTFT ms':>15} {'local TTFT ms':>14} {'remote / local':>15}")
    for n in lengths:
        ratio = remote[n] / local[n]
        rows.append(
            {
                "prompt_tokens": n,
                "remote_ttft_ms": round(remote[n] * 1e3, 2),
                "local_ttft_ms": round(local[n] * 1e3, 2),
                "ratio": round(ratio, 3),
            }
        )
        print(f"{n:>7} {remote[n] * 1e3:>15.1f} {local[n] * 1e3:>14.1f} {ratio:>15.2f}")
    pays = [r["prompt_tokens"] for r in rows if r["ratio"] <= 1.0]
    print("shortest prompt where the hand-off pays:", pays[0] if pays else "none measured")
    write_result(args.out, "bench.local_prefill", argv, args=vars(args), rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
