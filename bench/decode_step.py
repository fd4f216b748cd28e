"""Decode-step micro-benchmark: eager SDPA vs Triton paged attention vs Triton + CUDA graphs,
each with the decoder compiled by torch.compile (the engine's default) and without it.

For each model shape (random bf16 weights from a shipped config.json), batch size and
context length, times `ModelRunner.execute` on a pure-decode batch (host work, H2D
copies, forward, greedy sampling and the read of the tokens: one engine step) in three
modes, plus the GPU time of one graph replay. The KV cache holds random values, block
tables are shuffled. Each step rewrites the same positions, so the batch stays fixed.

The memory floor of a step is (weight bytes + KV bytes the attention must read) divided
by the device-to-device copy bandwidth measured in the same run (bytes read + written
per second of a large `copy_`). Example (on the GPU machine):

    python -m bench.decode_step --out $OUT/decode_step.json

Not a test: numbers depend on the card; compare only numbers from one run.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import os
import random
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from bench.report import percentile, provenance
from engine.core.batch import Batch, ScheduledSeq
from engine.model.model_spec import kv_bytes_per_token
from engine.sampling_params import GREEDY

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "deploy" / "model_configs"
BLOCK_SIZE = 16


def _mode_kwargs(mode: str) -> dict[str, Any]:
    """`ModelRunner.execute` keywords of a mode: eager SDPA, eager Triton, CUDA graphs."""
    return {"use_cuda_graphs": mode == "graphs", "paged_decode": False if mode == "sdpa" else None}


def int_list(text: str) -> list[int]:
    """A comma-separated flag as integers: "1,32,128" → [1, 32, 128]."""
    return [int(x) for x in text.split(",") if x]


def copy_bandwidth(nbytes: int = 2 << 30, reps: int = 20) -> float:
    """Bytes moved (read + written) per second by a large device-to-device copy."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    times = event_times(lambda: dst.copy_(src), reps)
    return 2 * nbytes / (statistics.median(times) / 1e3)


def event_times(fn: Any, reps: int, warmup: int = 3, calls: int = 1) -> list[float]:
    """Milliseconds per call of fn, timed with CUDA events, `reps` times. Each sample
    times `calls` calls back to back; with several, the host's launch of the first one
    (which the start event also times: the device waits for it) is spread over them."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return times


def wall_times(fn: Any, reps: int, warmup: int = 3) -> list[float]:
    """Milliseconds per call of fn (which must end in a host sync), by the host clock."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def time_stats(times: list[float]) -> dict[str, float]:
    """Median, p10 and p90 of a list of times."""
    return {
        "median": percentile(times, 50),
        "p10": percentile(times, 10),
        "p90": percentile(times, 90),
    }


def decode_batch(
    n: int, context: int, num_blocks: int, vocab_size: int, rng: random.Random
) -> Batch:
    """A pure-decode batch of n sequences, each with `context` tokens of KV (its new
    token's own K/V the last of them) in blocks drawn at random from the cache's
    `num_blocks`: no two sequences share a block, and reads are not in block order."""
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    per_seq = -(-context // BLOCK_SIZE)
    if n * per_seq > num_blocks:
        raise ValueError(
            f"{n} sequences of {context} tokens need {n * per_seq} blocks; the cache has "
            f"{num_blocks}"
        )
    return Batch(
        tuple(
            ScheduledSeq(
                f"r{i}",
                (rng.randrange(vocab_size),),
                context - 1,  # the new token's position: context tokens after its write
                tuple(ids[i * per_seq : (i + 1) * per_seq]),
                True,
                GREEDY,
                0,
            )
            for i in range(n)
        ),
        BLOCK_SIZE,
    )


def _classify(name: str) -> str:
    if "_decode_split" in name or "_merge_splits" in name or "_varlen" in name:
        return "attention (triton)"
    if name.startswith(("triton_poi", "triton_red", "triton_per")):
        return "fused by the compiler (norms, rotary, SiLU·mul, adds)"
    if any(k in name.lower() for k in ("gemm", "gemv", "cutlass", "sm90_", "cublas", "nvjet")):
        return "matmul"
    if "index" in name.lower() or "scatter" in name.lower():
        return "index/copy"
    return "other (elementwise, norms, rope...)"


def profile_step(fn: Any, label: str, log: list[str]) -> dict[str, float]:
    """GPU time per kernel class (ms) over one call of fn; appends the op table to log."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    by_class: dict[str, float] = {}
    count = 0
    for evt in prof.events():
        if str(getattr(evt, "device_type", "")).endswith("CUDA"):
            us = float(getattr(evt, "device_time", None) or getattr(evt, "cuda_time", 0.0) or 0.0)
            key = _classify(evt.name)
            by_class[key] = by_class.get(key, 0.0) + us / 1e3
            count += 1
    by_class["kernels"] = count
    sort = "self_device_time_total"
    try:
        table = prof.key_averages().table(sort_by=sort, row_limit=20)
    except Exception:
        table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=20)
    log.append(f"==== {label}\n{json.dumps(by_class)}\n{table}\n")
    print(f"profile {label}: {json.dumps({k: round(v, 3) for k, v in by_class.items()})}")
    return by_class


def bench_model(
    name: str,
    batch_sizes: list[int],
    contexts: list[int],
    steps: int,
    profile_at: set[tuple[int, int]] | None = None,
    profile_log: list[str] | None = None,
    compile_model: bool = True,
    gemv: str = "on",
    kv_write: str = "fused",
    compile_scope: str = "layer",
) -> list[dict[str, Any]]:
    """Time every (batch, context) of one model shape in each mode, with the decoder
    compiled (the default engine) or as transformers runs it, and one-row products on
    the Triton GEMV (the default: "on", with q/k/v and gate/up packed into one product
    each), on the GEMV with every projection its own product ("unpacked"), or on cuBLAS
    ("off"); a decode step's K/V written by the attention kernel ("fused", the default)
    or by a kernel of its own first ("separate"). `compile_scope`: each decoder layer
    compiled (the engine's default) or the whole stack (engine.model.compiled)."""
    from unittest import mock

    from engine.model import attention
    from engine.model.kernels import triton_gemv
    from engine.model.model_runner import ModelRunner

    max_blocks = -(-(max(contexts) + 1) // BLOCK_SIZE)
    num_blocks = max(batch_sizes) * max_blocks
    t0 = time.perf_counter()
    packing = () if gemv == "unpacked" else triton_gemv.PACKED_SIBLINGS
    attend_paged = attention._attend_paged

    def write_then_attend(*args: Any) -> torch.Tensor:  # the K/V write as its own kernel
        query, kv_cache, layer_idx, group, scale, *new_kv = args
        if new_kv and new_kv[0] is not None:
            key, value, meta = new_kv[0]
            attention.write_kv(kv_cache, layer_idx, key, value, meta)
        return attend_paged(query, kv_cache, layer_idx, group, scale)

    separate = kv_write == "separate"
    # Patched for the whole measurement (capture, eager steps and profiles alike).
    with (
        mock.patch.object(triton_gemv, "PACKED_SIBLINGS", packing),
        mock.patch.object(attention, "_attend_paged", write_then_attend)
        if separate
        else contextlib.nullcontext(),
    ):
        runner = ModelRunner(
            CONFIGS / name,
            device="cuda",
            dtype="bfloat16",
            load_format="dummy",
            num_blocks=num_blocks,
            block_size=BLOCK_SIZE,
            cuda_graph_batch_sizes=batch_sizes,
            compile_model=compile_model,
            compile_scope=compile_scope,
            small_batch_gemv=gemv != "off",
        )
        load_s = time.perf_counter() - t0
        graphs = runner.cuda_graphs
        if graphs is None:
            raise RuntimeError("CUDA graph capture failed (see the log)")
        runner._kv_storage.normal_()  # random K/V: never time on zeros
        spec = runner.spec
        weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        kv_token_bytes = spec.kv_bytes_per_token
        vocab = spec.vocab_size
        rng = random.Random(0)
        rows = []
        for ctx in contexts:
            for n in batch_sizes:
                batch = decode_batch(n, ctx, num_blocks, vocab, rng)
                kv_bytes = n * ctx * kv_token_bytes
                row: dict[str, Any] = {
                    "model": name,
                    "compiled": compile_model,
                    "compile_scope": compile_scope if compile_model else None,
                    "gemv": gemv,
                    "kv_write": kv_write,
                    "batch": n,
                    "context": ctx,
                    "weight_bytes": weight_bytes,
                    "kv_bytes": kv_bytes,
                    "load_s": round(load_s, 1),
                }
                for mode in ("sdpa", "triton", "graphs"):
                    kw = _mode_kwargs(mode)
                    try:
                        row[f"{mode}_ms"] = time_stats(
                            wall_times(lambda b=batch, kw=kw: runner.execute(b, **kw), steps)
                        )
                    except Exception as exc:  # keep the other numbers of this run
                        traceback.print_exc()
                        row[f"{mode}_error"] = repr(exc)
                graphs.run(batch)  # fill the static inputs for this batch
                size = next(s for s in graphs.batch_sizes if s >= n)
                graph = graphs._graphs[size][0]
                row["graph_gpu_ms"] = time_stats(event_times(graph.replay, steps))
                row["graph_gpu_back_to_back_ms"] = time_stats(
                    event_times(graph.replay, steps, calls=10)
                )
                if profile_at and (n, ctx) in profile_at and profile_log is not None:
                    for mode in ("triton", "graphs"):
                        kw = _mode_kwargs(mode)
                        try:
                            row[f"{mode}_profile_ms"] = profile_step(
                                lambda b=batch, kw=kw: runner.execute(b, **kw),
                                f"{name} batch {n} ctx {ctx} {mode} "
                                f"compiled={compile_model} gemv={gemv} kv_write={kv_write}",
                                profile_log,
                            )
                        except Exception:
                            traceback.print_exc()
                rows.append(row)
                print(json.dumps(row), flush=True)
        return rows


def bench_kernel(batch_sizes: list[int], context: int) -> list[dict[str, Any]]:
    """One layer of the Triton decode kernel on the Llama-3.1-8B shape, per tile size."""
    from engine.model.kernels import triton_attention as ta

    rows = []
    default_block_n = ta._BLOCK_N
    try:
        for n in batch_sizes:
            for block_n in (16, 32, 64):
                ta._BLOCK_N = block_n
                try:
                    rows.append(_kernel_row(n, context, block_n))
                except Exception as exc:
                    traceback.print_exc()
                    rows.append({"batch": n, "block_n": block_n, "error": repr(exc)})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        ta._BLOCK_N = default_block_n
    torch.cuda.empty_cache()
    return rows


def _kernel_row(n: int, context: int, block_n: int) -> dict[str, Any]:
    from engine.model.kernels import triton_attention as ta

    heads, kv_heads, head_dim = 32, 8, 128
    per_seq = -(-context // BLOCK_SIZE)
    num_blocks = n * per_seq
    cache = torch.randn(
        (num_blocks, 1, 2, BLOCK_SIZE, kv_heads, head_dim), device="cuda", dtype=torch.bfloat16
    )
    table = torch.randperm(num_blocks, device="cuda").view(n, per_seq).to(torch.int32)
    ctx = torch.full((n,), context, dtype=torch.int32, device="cuda")
    q = torch.randn((n, heads, head_dim), device="cuda", dtype=torch.bfloat16)
    splits = ta.num_splits_for(n, kv_heads, context, q.device)
    times = event_times(
        lambda: ta.paged_decode_attention(q, cache, 0, table, ctx, head_dim**-0.5, splits), 50
    )
    ms = statistics.median(times)
    kv_bytes = n * context * kv_bytes_per_token(1, kv_heads, head_dim, 2)  # one layer, bf16
    return {
        "batch": n,
        "context": context,
        "block_n": block_n,
        "splits": splits,
        "ms": ms,
        "kv_GBps": kv_bytes / (ms / 1e3) / 1e9,
    }


def _compile_label(row: dict[str, Any]) -> str:
    if not row["compiled"]:
        return "off"
    return "dec" if row.get("compile_scope") == "decoder" else "on"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="llama-3.2-1b,llama-3.1-8b")
    p.add_argument("--batch-sizes", type=int_list, default=[1, 32, 128])
    p.add_argument("--contexts", type=int_list, default=[512, 2048])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument(
        "--compile",
        default="on,off",
        help="on (each decoder layer compiled, as the engine does), decoder (the whole "
        "stack compiled), off (as transformers runs it), or several (on,decoder,off)",
    )
    p.add_argument(
        "--gemv",
        default="on",
        help="on, unpacked, off, or several (on,off): one-row products on the Triton GEMV "
        "(q/k/v and gate/up packed), on the GEMV one product per projection, on cuBLAS",
    )
    p.add_argument(
        "--kv-write",
        default="fused",
        help="fused, separate or both: a decode step's K/V written by the attention "
        "kernel where the step splits contexts (the default), or always by a kernel of its "
        "own first",
    )
    p.add_argument(
        "--profile",
        default="llama-3.2-1b:128:512,llama-3.1-8b:1:512,llama-3.1-8b:128:2048",
        help="model:batch:context triples to profile (GPU time per kernel class)",
    )
    p.add_argument("--out", type=Path, default=None, help="JSON path (default: $OUT or bench/)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    out = args.out or (
        Path(os.environ["OUT"]) / "decode_step.json"
        if os.environ.get("OUT")
        else REPO / "bench" / "results" / "decode_step.json"
    )
    import triton

    bandwidth = copy_bandwidth()
    print(f"device-to-device copy: {bandwidth / 1e9:.0f} GB/s (read + write)", flush=True)
    result: dict[str, Any] = {
        "provenance": provenance("bench.decode_step", sys.argv[1:] if argv is None else argv),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "copy_GBps": bandwidth / 1e9,
        "steps": [],
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    profiles = [t.split(":") for t in args.profile.split(",") if t]
    profile_log: list[str] = []
    compile_modes = [c for c in args.compile.split(",") if c]
    if not set(compile_modes) <= {"on", "decoder", "off"}:
        p.error(f"--compile takes on, decoder and off, not {args.compile!r}")
    gemv_modes = [c for c in args.gemv.split(",") if c]
    if not set(gemv_modes) <= {"on", "unpacked", "off"}:
        p.error(f"--gemv takes on, unpacked and off, not {args.gemv!r}")
    kv_writes = [c for c in args.kv_write.split(",") if c]
    if not set(kv_writes) <= {"fused", "separate"}:
        p.error(f"--kv-write takes fused and separate, not {args.kv_write!r}")
    for name, compile_mode, gemv, kv_write in itertools.product(
        args.models.split(","), compile_modes, gemv_modes, kv_writes
    ):
        compile_model = compile_mode != "off"
        compile_scope = "decoder" if compile_mode == "decoder" else "layer"
        at = {(int(b), int(c)) for m, b, c in profiles if m == name}
        try:
            result["steps"] += bench_model(
                name,
                args.batch_sizes,
                args.contexts,
                args.steps,
                at,
                profile_log,
                compile_model,
                gemv,
                kv_write,
                compile_scope,
            )
        except Exception as exc:
            traceback.print_exc()
            result.setdefault("errors", []).append(
                f"{name} compile={compile_mode} gemv={gemv} kv_write={kv_write}: {exc!r}"
            )
        gc.collect()  # the runner of this model goes before the next one loads
        torch.cuda.empty_cache()
        for row in result["steps"]:
            row["floor_ms"] = (row["weight_bytes"] + row["kv_bytes"]) / bandwidth * 1e3
        out.write_text(json.dumps(result, indent=2))  # partial results survive a timeout
        if profile_log:
            out.with_name("decode_profile.txt").write_text("\n".join(profile_log))
    result["kernel"] = bench_kernel(args.batch_sizes, max(args.contexts))
    out.write_text(json.dumps(result, indent=2))

    print(f"\n{result['device']}, copy {bandwidth / 1e9:.0f} GB/s; ms per decode step (median)")
    head = f"{'model':14} {'comp':>4} {'gemv':>8} {'kv write':>8} {'batch':>5} {'ctx':>5}"
    print(
        head + f" {'floor':>7} {'sdpa':>7} {'triton':>7} {'graphs':>7} {'gpu':>7} {'gpu b2b':>7}"
        f" {'×floor':>7} {'b2b×fl':>7}"
    )
    for r in result["steps"]:

        def ms(key: str, r: dict[str, Any] = r) -> str:
            return f"{r[key]['median']:7.3f}" if key in r else "    err"

        def ratio(key: str, r: dict[str, Any] = r) -> str:
            return f"{r[key]['median'] / r['floor_ms']:7.2f}" if key in r else "    err"

        print(
            f"{r['model']:14} {_compile_label(r):>4} "
            f"{r['gemv']:>8} {r['kv_write']:>8} {r['batch']:5d} "
            f"{r['context']:5d} {r['floor_ms']:7.3f} "
            f"{ms('sdpa_ms')} {ms('triton_ms')} {ms('graphs_ms')} {ms('graph_gpu_ms')} "
            f"{ms('graph_gpu_back_to_back_ms')} {ratio('graph_gpu_ms')} "
            f"{ratio('graph_gpu_back_to_back_ms')}"
        )
    starts = {
        (r["model"], _compile_label(r), r["gemv"], r["kv_write"]): r["load_s"]
        for r in result["steps"]
    }
    print("\nrunner start-up (weights, compile, graph capture), s:")
    for (model, comp, gemv, kv_write), load_s in starts.items():
        print(f"  {model:14} {comp:>4} {gemv:>8} {kv_write:>8} {load_s:7.1f}")
    print("\nTriton kernel, one 8B layer: batch ctx block_n splits ms GB/s")
    for k in result["kernel"]:
        if "ms" in k:
            print(
                f"  {k['batch']:5d} {k['context']:5d} {k['block_n']:4d} {k['splits']:3d} "
                f"{k['ms']:.4f} {k['kv_GBps']:.0f}"
            )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
