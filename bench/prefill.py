"""Prefill throughput against the GEMM rate of the same card, measured in the same run.

Times `ModelRunner.execute` on one packed step of `--num-prompts` prompts of
`--prompt-len` random tokens (random bf16 weights of a shipped config), through the
Triton varlen attention (with the decoder as transformers runs it, then compiled as a
decode engine runs its eager steps) and through padded SDPA. The reference is the bf16 GEMM rate of
a large square matmul divided by the FLOPs per token (2 x parameters, plus the causal
attention's 2 x 2 x layers x heads x head_dim x mean context), so 1.0 would be a step
running entirely at GEMM speed. Example (on the GPU machine):

    python -m bench.prefill --model llama-3.1-8b --out $OUT/prefill.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.report import provenance

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "deploy" / "model_configs"


def gemm_flops_per_s(n: int = 8192, reps: int = 20) -> float:
    """bf16 FLOP/s of an n x n x n matmul (median of `reps`, CUDA events)."""
    a = torch.randn((n, n), device="cuda", dtype=torch.bfloat16)
    b = torch.randn((n, n), device="cuda", dtype=torch.bfloat16)
    times = _times(lambda: a @ b, reps)
    return 2 * n**3 / statistics.median(times)


def _times(fn: Any, reps: int, warmup: int = 2) -> list[float]:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", type=Path, default=None)
    ns = p.parse_args()

    from engine.core.batch import Batch, ScheduledSeq
    from engine.model.compiled import compile_decoder
    from engine.model.model_runner import ModelRunner
    from engine.sampling_params import GREEDY

    block_size = 16
    per_seq = -(-ns.prompt_len // block_size)
    runner = ModelRunner(
        CONFIGS / ns.model,
        device="cuda",
        dtype="bfloat16",
        load_format="dummy",
        num_blocks=ns.num_prompts * per_seq,
        block_size=block_size,
        enforce_eager=True,
        compile_model=False,  # compiled below, after the uncompiled modes
    )
    spec = runner.spec
    rng = random.Random(0)
    batch = Batch(
        tuple(
            ScheduledSeq(
                f"r{i}",
                tuple(rng.randrange(spec.vocab_size) for _ in range(ns.prompt_len)),
                0,
                tuple(range(i * per_seq, (i + 1) * per_seq)),
                True,
                GREEDY,
                0,
            )
            for i in range(ns.num_prompts)
        ),
        block_size,
    )
    num_tokens = ns.num_prompts * ns.prompt_len
    params = sum(p.numel() for p in runner.model.parameters())
    attn = 4 * spec.num_layers * spec.num_q_heads * spec.head_dim * (ns.prompt_len + 1) / 2
    flops_per_token = 2 * params + attn
    gemm = gemm_flops_per_s()
    result: dict[str, Any] = {
        "provenance": provenance("bench.prefill", sys.argv[1:]),
        "model": ns.model,
        "device": torch.cuda.get_device_name(),
        "num_prompts": ns.num_prompts,
        "prompt_len": ns.prompt_len,
        "parameters": params,
        "flops_per_token": flops_per_token,
        "gemm_tflops": round(gemm / 1e12, 1),
        "gemm_bound_tok_s": round(gemm / flops_per_token),
    }
    for mode, paged in (
        ("triton_varlen", None),
        ("sdpa_padded", False),
        ("triton_varlen_compiled", None),
    ):
        if mode == "triton_varlen_compiled":
            compile_decoder(runner.model)  # compiles in _times' warm-up
        times = _times(lambda p=paged: runner.execute(batch, paged_decode=p), ns.reps)
        step = statistics.median(times)
        result[f"{mode}_step_ms"] = round(1000 * step, 2)
        result[f"{mode}_tok_s"] = round(num_tokens / step)
        result[f"{mode}_vs_gemm_bound"] = round(num_tokens / step / (gemm / flops_per_token), 3)
    print(json.dumps(result, indent=2))
    out = ns.out or (Path(os.environ["OUT"]) / "prefill.json" if "OUT" in os.environ else None)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
