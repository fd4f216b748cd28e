"""The decode step of a model split over tensor-parallel sizes, side by side in one run.

For each model shape (random bf16 weights from deploy/model_configs/<name>/config.json,
or any model folder), TP size and batch size, `tp` processes (rank r on cuda:r, NCCL; on
CPU, processes over gloo) each build the engine's `ModelRunner` for their rank (the
engine's defaults: compiled decoder, CUDA graphs) and time `runner.execute` of the same
pure-decode batch, every sequence holding `--context` tokens of random KV
(bench.tp_decode_rank). Rank 0 reports, per (model, tp, batch):

* the median step (host clock: one engine step, its tokens read back);
* with CUDA graphs, the GPU time of the step's graph replayed alone;
* the memory floor of one rank: its weight bytes plus the KV bytes its heads' attention
  reads, over the device copy bandwidth measured in the same run;
* step ÷ floor, and step ÷ the step of the same model and batch at TP 1;
* one all-reduce of a [batch, hidden] tensor on the group, alone (launched one by one,
  and replayed from a CUDA graph), and its share of the step: 2 per layer × layers × its
  time ÷ step (the embedding's all-reduce and the logits' all-gather are not counted).

Each (model, TP size) runs in processes of its own, so its memory is gone before the next
one starts, and the JSON is rewritten after each (and after each batch of the one
running), so a timeout keeps what finished. Sizes needing more GPUs than present, or
more memory than a GPU has (a 70B shape at TP 1), are skipped with a note.

    python -m bench.tp_decode --out $OUT/tp_decode.json
    python -m bench.tp_decode --models llama-3.1-8b --tp-sizes 1,2 --eager

Not a test: numbers depend on the cards and their links; compare only numbers of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from bench.report import provenance
from bench.suite_common import model_path
from bench.tp_decode_rank import BLOCK_SIZE, RankJob, log, rank_main
from engine.model.model_spec import kv_bytes_per_token
from engine.parallel.tp_heads import num_local_kv_heads, tp_size_problem

REPO = Path(__file__).resolve().parents[1]

# NVLink multicast (NVLS) can take a shared host's GPUs down: off in every rank.
NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
# What a rank holds besides its weights and KV: the compiler's and cuBLAS's workspaces,
# the graphs' pool, NCCL's buffers, one full-size tensor while random weights are drawn.
HEADROOM_BYTES = 8 << 30


def int_list(text: str) -> list[int]:
    """A comma-separated flag as integers: "1,32,128" → [1, 32, 128]."""
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--models",
        default="llama-3.1-8b,llama-70b",
        help="names under deploy/model_configs, or model folders (config.json)",
    )
    p.add_argument("--tp-sizes", type=int_list, default=[1, 2, 4])
    p.add_argument("--batch-sizes", type=int_list, default=[1, 64, 128])
    p.add_argument("--context", type=int, default=1024, help="tokens of KV per sequence")
    p.add_argument("--steps", type=int, default=50, help="timed steps per batch size")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    p.add_argument("--all-reduce-reps", type=int, default=100)
    p.add_argument(
        "--kv-cache-gib",
        type=float,
        default=32.0,
        help="most KV cache per rank (GiB): the cache holds what the largest batch needs at "
        "--context; batch sizes needing more are skipped with a note",
    )
    p.add_argument("--eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--no-compile", action="store_true", help="the decoder as transformers runs it")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda if any")
    p.add_argument(
        "--config-timeout",
        type=float,
        default=240.0,
        help="seconds one (model, TP size) may take before its ranks are killed",
    )
    p.add_argument("--out", type=Path, default=None, help="JSON path (default: $OUT or bench/)")
    args = p.parse_args(argv)
    if args.context < 1 or args.steps < 1 or args.warmup < 0 or args.all_reduce_reps < 1:
        p.error("--context, --steps and --all-reduce-reps must be >= 1, --warmup >= 0")
    if not args.batch_sizes or min(args.batch_sizes) < 1 or min(args.tp_sizes, default=0) < 1:
        p.error("--batch-sizes and --tp-sizes take positive integers")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    elif args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    return args


def _num_params(path: Path) -> int:
    """Parameters of the whole model (built on the meta device: no memory, no weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


class Plan:
    """Which (TP size, batch sizes) of one model run here, and why the others do not."""

    def __init__(self, path: Path, args: argparse.Namespace, gpu_bytes: int | None) -> None:
        config = json.loads((path / "config.json").read_text())
        self.num_q_heads = int(config["num_attention_heads"])
        self.num_kv_heads = int(config.get("num_key_value_heads") or self.num_q_heads)
        self.head_dim = int(config.get("head_dim") or config["hidden_size"] // self.num_q_heads)
        self.num_layers = int(config["num_hidden_layers"])
        self.max_model_len = int(config["max_position_embeddings"])
        self.args = args
        self.itemsize = 2 if args.device == "cuda" else 4  # bf16 on CUDA, float32 on CPU
        self.gpu_bytes = gpu_bytes
        self.weight_bytes = _num_params(path) * self.itemsize if gpu_bytes else 0
        self.blocks_per_seq = -(-args.context // BLOCK_SIZE)

    def kv_bytes(self, tp: int, batch: int) -> int:
        """One rank's cache for `batch` sequences of the context."""
        local = num_local_kv_heads(self.num_kv_heads, tp)
        per_token = kv_bytes_per_token(self.num_layers, local, self.head_dim, self.itemsize)
        return batch * self.blocks_per_seq * BLOCK_SIZE * per_token

    def kv_ceiling(self, tp: int) -> float:
        """The most KV cache one rank may hold: --kv-cache-gib, or what its GPU has left
        beside its weights."""
        ceiling = self.args.kv_cache_gib * 2**30
        if self.gpu_bytes:
            left = self.gpu_bytes - self.weight_bytes // tp - HEADROOM_BYTES
            ceiling = min(ceiling, left)
        return ceiling

    def skip_reason(self, tp: int) -> str | None:
        """Why this TP size does not run here, or None."""
        if self.args.context >= self.max_model_len:
            return f"context {self.args.context} reaches the model's {self.max_model_len}"
        problem = tp_size_problem(self.num_q_heads, self.num_kv_heads, tp)
        if problem:
            return problem
        if self.args.device == "cuda" and tp > torch.cuda.device_count():
            return f"needs {tp} GPUs, {torch.cuda.device_count()} present"
        if self.gpu_bytes and self.kv_ceiling(tp) <= 0:
            return (
                f"does not fit: {self.weight_bytes / tp / 2**30:.0f} GiB of weights per rank, "
                f"{self.gpu_bytes / 2**30:.0f} GiB per GPU"
            )
        return None

    def batch_sizes(self, tp: int) -> tuple[tuple[int, ...], str | None]:
        """The batch sizes whose KV fits one rank, and a note naming the others."""
        ceiling = self.kv_ceiling(tp)
        sizes = sorted(set(self.args.batch_sizes))
        fits = tuple(n for n in sizes if self.kv_bytes(tp, n) <= ceiling)
        over = [f"{n} ({self.kv_bytes(tp, n) / 2**30:.3g} GiB)" for n in sizes if n not in fits]
        if not over:
            return fits, None
        return fits, (
            f"batch {', '.join(over)} skipped: KV per rank over the "
            f"{ceiling / 2**30:.3g} GiB a rank may hold (--kv-cache-gib)"
        )


def run_config(job: RankJob, timeout_s: float) -> tuple[dict[str, Any] | None, str | None]:
    """Spawn the job's ranks and wait for them; (rank 0's record, an error or None). Ranks
    still running at the deadline are killed (a rank stuck in a collective never ends)."""
    error = None
    context = mp.start_processes(rank_main, args=(job,), nprocs=job.tp, join=False)
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=2.0):
            if time.monotonic() > deadline:
                error = f"timed out after {timeout_s:.0f} s"
                break
    except Exception as exc:  # a rank raised or died; join has stopped the others
        log(f"{job.model} TP {job.tp} failed:\n{exc}")
        error = str(exc).strip().splitlines()[-1] if str(exc).strip() else repr(exc)
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join()
    out = Path(job.out)
    record = json.loads(out.read_text()) if out.is_file() else None
    return record, error


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Each row's step ÷ the step of the same model, context and batch at TP 1."""
    single = {(r["model"], r["context"], r["batch"]): r for r in rows if r["tp"] == 1}
    for r in rows:
        base = single.get((r["model"], r["context"], r["batch"]))
        if base is not None and r["tp"] != 1:
            r["vs_tp1"] = r["step_ms"]["median"] / base["step_ms"]["median"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.out or (
        Path(os.environ["OUT"]) / "tp_decode.json"
        if os.environ.get("OUT")
        else REPO / "bench" / "results" / "tp_decode.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    use_cuda = args.device == "cuda"
    os.environ.update(NO_MULTICAST)  # the ranks inherit it
    gpu_bytes = torch.cuda.get_device_properties(0).total_memory if use_cuda else None
    result: dict[str, Any] = {
        "provenance": provenance("bench.tp_decode", sys.argv[1:] if argv is None else argv),
        "device": torch.cuda.get_device_name(0) if use_cuda else "cpu",
        "num_gpus": torch.cuda.device_count() if use_cuda else 0,
        "context": args.context,
        "steps": args.steps,
        "compile": not args.no_compile,
        "cuda_graphs": not args.eager,
        "copy_GBps": None,
        "rows": [],
        "notes": [],
        "errors": [],
    }

    def note(key: str, text: str) -> None:
        log(text)
        result[key].append(text)

    with tempfile.TemporaryDirectory(prefix="tp-decode-") as tmp:
        for name in (m for m in args.models.split(",") if m):
            path = model_path(name, Path(tmp))
            plan = Plan(path, args, gpu_bytes)
            model = path.resolve().name
            for tp in args.tp_sizes:
                reason = plan.skip_reason(tp)
                if reason:
                    note("notes", f"{model} TP {tp}: skipped: {reason}")
                    continue
                batch_sizes, too_big = plan.batch_sizes(tp)
                if too_big:
                    note("notes", f"{model} TP {tp}: {too_big}")
                if not batch_sizes:
                    continue
                job = RankJob(
                    model=model,
                    path=str(path),
                    tp=tp,
                    batch_sizes=batch_sizes,
                    context=args.context,
                    steps=args.steps,
                    warmup=args.warmup,
                    all_reduce_reps=args.all_reduce_reps,
                    num_blocks=max(batch_sizes) * plan.blocks_per_seq,
                    use_cuda=use_cuda,
                    compile_model=False if args.no_compile else None,
                    enforce_eager=args.eager,
                    rendezvous=str(Path(tmp) / f"rendezvous-{uuid.uuid4().hex}"),
                    out=str(Path(tmp) / f"{model}-tp{tp}.json"),
                )
                log(f"{model} TP {tp}: starting {tp} rank(s), batch sizes {list(batch_sizes)}")
                record, error = run_config(job, args.config_timeout)
                if error:
                    note("errors", f"{model} TP {tp}: {error}")
                if record:
                    result["rows"] += record["rows"]
                    result["copy_GBps"] = result["copy_GBps"] or record["copy_GBps"]
                add_ratios(result["rows"])
                out.write_text(json.dumps(result, indent=1))  # partial results survive
    out.write_text(json.dumps(result, indent=1))
    print_table(result)
    print(f"wrote {out}")
    return 1 if result["errors"] and not result["rows"] else 0


def print_table(result: dict[str, Any]) -> None:
    """One line per (model, tp, batch); blanks where a number does not apply."""
    copy = result["copy_GBps"]
    print(
        f"\n{result['device']}, context {result['context']}"
        + (f", copy {copy:.0f} GB/s (read + write)" if copy else "")
        + "; ms per decode step (median; gpu: its graph alone); all-reduce of [batch, hidden], µs"
    )
    print(
        f"{'model':14} {'tp':>3} {'batch':>5} {'step':>8} {'gpu':>8} {'floor':>8} {'×floor':>7} "
        f"{'÷TP1':>6} {'AR':>7} {'AR graph':>8} {'AR share':>8}"
    )

    def num(row: dict[str, Any], key: str, width: int, fmt: str) -> str:
        value = row.get(key)
        if isinstance(value, dict):
            value = value["median"]
        return f"{value:{width}{fmt}}" if value is not None else " " * width

    for r in result["rows"]:
        print(
            f"{r['model']:14} {r['tp']:3d} {r['batch']:5d} {num(r, 'step_ms', 8, '.3f')} "
            f"{num(r, 'graph_gpu_ms', 8, '.3f')} "
            f"{num(r, 'floor_ms', 8, '.3f')} {num(r, 'step_over_floor', 7, '.2f')} "
            f"{num(r, 'vs_tp1', 6, '.2f')} {num(r, 'all_reduce_us', 7, '.1f')} "
            f"{num(r, 'all_reduce_graph_us', 8, '.1f')} {num(r, 'all_reduce_share', 8, '.1%')}"
        )
    for text in result["notes"] + result["errors"]:
        print(f"  {text}")


if __name__ == "__main__":
    sys.exit(main())
