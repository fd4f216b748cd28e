"""GEMV micro-benchmark: the Triton small-batch GEMV against cuBLAS (`F.linear`).

For every projection of a model shape (q, k/v, o, gate/up, down, lm_head, and q/k/v and
gate/up packed into one product each, as one-row steps run them) and a few row
counts (the decode batch), times both inside one CUDA graph per measurement that runs the
product over enough distinct copies of the weight to exceed the L2 cache, as a decode
step does (each weight is read once per step, never from cache). Reports microseconds per
product, the weight-read rate, and the Triton kernel's result against a float32
reference. `--sweep` also times a grid of kernel configurations and reports the best per
shape, which is how `engine.model.kernels.triton_gemv.default_config` was chosen.

    python -m bench.gemv --out $OUT/gemv.json [--sweep]

Not a test: numbers depend on the card; compare only numbers from one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.report import provenance
from engine.model.kernels.triton_gemv import GemvConfig, default_config, gemv

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "deploy" / "model_configs"
L2_ESCAPE_BYTES = 256 << 20
SWEEP = [
    GemvConfig(bn, bk, w, late)
    for bn, bk, w in [
        (1, 2048, 4),
        (2, 1024, 4),
        (2, 2048, 4),
        (2, 2048, 8),
        (2, 4096, 8),
        (4, 2048, 4),
        (4, 4096, 8),
        (4, 512, 4),
        (4, 1024, 4),
        (4, 1024, 8),
        (4, 2048, 8),
        (8, 256, 4),
        (8, 512, 4),
        (8, 1024, 8),
        (16, 256, 4),
        (16, 512, 8),
        (32, 128, 4),
        (32, 256, 8),
        (64, 128, 8),
    ]
    for late in (False, True)
]


def shapes_of(model: str) -> dict[str, tuple[int, int]]:
    """Projection name -> (out features, in features) from a shipped config.json."""
    cfg = json.loads((CONFIGS / model / "config.json").read_text())
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", heads)
    head_dim = cfg.get("head_dim") or h // heads
    return {
        "q": (heads * head_dim, h),
        "k/v": (kv_heads * head_dim, h),
        "q+k+v packed": ((heads + 2 * kv_heads) * head_dim, h),
        "o": (h, heads * head_dim),
        "gate/up": (inter, h),
        "gate+up packed": (2 * inter, h),
        "down": (h, inter),
        "lm_head": (cfg["vocab_size"], h),
    }


def time_graph(fn: Any, reps: int = 10) -> float:
    """Median milliseconds of one replay of a CUDA graph of fn()."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(n: int, k: int, m: int, configs: list[GemvConfig | None]) -> dict[str, Any]:
    wbytes = n * k * 2
    copies = max(1, min(64, -(-L2_ESCAPE_BYTES // wbytes)))
    weights = torch.randn(copies, n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ref = (x.float() @ weights[0].float().T).to(torch.float32)

    def per_call_us(product: Any) -> float:
        def run() -> None:
            for i in range(copies):
                product(weights[i])

        return 1e3 * time_graph(run) / copies

    cublas_us = per_call_us(lambda w: F.linear(x, w))
    cublas_err = (F.linear(x, weights[0]).float() - ref).abs().max().item()
    row: dict[str, Any] = {
        "n": n,
        "k": k,
        "m": m,
        "weight_mb": wbytes / 1e6,
        "cublas_us": cublas_us,
        "cublas_tbs": wbytes / cublas_us / 1e6,
        "cublas_max_err": cublas_err,
        "configs": [],
    }
    for cfg in configs:
        if cfg is not None and cfg.reduce_late and m > 2:
            continue
        if cfg is not None and cfg.block_k > k:
            continue
        try:
            us = per_call_us(lambda w, c=cfg: gemv(x, w, config=c))
            err = (gemv(x, weights[0], config=cfg).float() - ref).abs().max().item()
        except Exception as exc:  # noqa: BLE001 - a config the compiler rejects is skipped
            print(f"  skip {cfg}: {type(exc).__name__}: {exc}"[:200], file=sys.stderr)
            continue
        row["configs"].append(
            {
                "config": (cfg or default_config(m, n, k))._asdict(),
                "default": cfg is None,
                "us": us,
                "tbs": wbytes / us / 1e6,
                "max_err": err,
            }
        )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama-3.2-1b,llama-3.1-8b")
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--sweep", action="store_true", help="also time a grid of configs")
    parser.add_argument("--out", type=Path, default=Path("gemv.json"))
    args = parser.parse_args()
    configs: list[GemvConfig | None] = [None] + (SWEEP if args.sweep else [])
    results = []
    header = f"{'model':<14}{'proj':<9}{'m':>3}{'MB':>8}{'cuBLAS us':>11}{'TB/s':>7}"
    header += f"{'triton us':>11}{'TB/s':>7}{'ratio':>7}{'best us':>9}  best config"
    print(header)
    for model in args.models.split(","):
        for proj, (n, k) in shapes_of(model).items():
            for m in (int(r) for r in args.rows.split(",")):
                row = measure(n, k, m, configs)
                row.update(model=model, proj=proj)
                results.append(row)
                default = next(c for c in row["configs"] if c["default"])
                best = min(row["configs"], key=lambda c: c["us"])
                print(
                    f"{model:<14}{proj:<9}{m:>3}{row['weight_mb']:>8.1f}"
                    f"{row['cublas_us']:>11.1f}{row['cublas_tbs']:>7.2f}"
                    f"{default['us']:>11.1f}{default['tbs']:>7.2f}"
                    f"{row['cublas_us'] / default['us']:>7.2f}{best['us']:>9.1f}"
                    f"  {tuple(best['config'].values())} err {default['max_err']:.2g}"
                    f"/{row['cublas_max_err']:.2g}",
                    flush=True,
                )
    args.out.write_text(
        json.dumps(
            {
                "provenance": provenance("bench.gemv", sys.argv[1:]),
                "device": torch.cuda.get_device_name(),
                "results": results,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
