"""The decode step of a model split over tensor-parallel sizes, side by side in one run.

Per model (random weights of deploy/model_configs/<name>, or any model folder), TP size
and batch size, one process per rank times the engine's `ModelRunner` on the same
pure-decode batch; rank 0 reports the median step, its graph's GPU time, step ÷ the
memory floor and ÷ TP 1, and one all-reduce of [batch, hidden] alone (docs/benchmarks.md,
"Tensor parallelism"). The JSON is rewritten after each batch; sizes needing more GPUs
or memory than present are skipped with a note.

    python -m bench.tp_decode --out $OUT/tp_decode.json
    python -m bench.tp_decode --models llama-3.1-8b --tp-sizes 1,2 --eager
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.device import free
from bench.harness.tp_ranks import end_rank
from bench.report import REPO, device_out, int_list, percentile, provenance, text_table
from bench.suite_common import model_path
from engine.core.batch import Batch, ScheduledSeq
from engine.model.compiled import is_compiled
from engine.model.cuda_graphs import DecodeGraphs
from engine.model.model_runner import ModelRunner
from engine.model.model_spec import kv_bytes_per_token
from engine.parallel.tensor_parallel import TPRank, all_reduce, join_tp_group
from engine.parallel.tp_heads import num_local_kv_heads, tp_size_problem
from engine.sampling_params import GREEDY

BLOCK_SIZE = 16

# All-reduces per timed sample of the all-reduce alone: back to back, so a sample is not
# one launch's host latency (and the graph replays them as the model's graph does).
ALL_REDUCES_PER_SAMPLE = 10
# A layer's two row-parallel products (attention output, MLP down) each end in one.
ALL_REDUCES_PER_LAYER = 2


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


@dataclass(frozen=True)
class RankJob:
    """What each rank of one (model, TP size) configuration builds and times."""

    model: str  # the name rows carry
    path: str  # the model folder (config.json; weights are random)
    tp: int
    batch_sizes: tuple[int, ...]
    context: int
    steps: int
    warmup: int
    all_reduce_reps: int
    num_blocks: int
    use_cuda: bool
    compile_model: bool | None  # None: the engine's default (compiled on CUDA)
    enforce_eager: bool
    rendezvous: str  # a file path: the group's rendezvous
    out: str  # rank 0's JSON of the rows so far

    def __post_init__(self) -> None:
        if not self.batch_sizes:
            raise ValueError("a configuration needs at least one batch size")
        if self.steps < 1 or self.warmup < 0 or self.all_reduce_reps < 1:
            raise ValueError("steps and all-reduce reps must be >= 1, warm-up >= 0")


def log(message: str) -> None:
    """One progress line with the wall-clock time (ranks and the driver alike)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def rank_main(rank: int, job: RankJob) -> None:
    """Entry point of one spawned rank: rank r on cuda:r (or a CPU process over gloo)."""
    device = torch.device("cuda", rank) if job.use_cuda else torch.device("cpu")
    copy_bytes_per_s = None
    if job.use_cuda:
        torch.cuda.set_device(device)  # before anything else touches the device
        if rank == 0:
            copy_bytes_per_s = copy_bandwidth()
            free(device)  # its two buffers go before the model loads
    else:
        torch.set_num_threads(1)  # the ranks share the host's cores
    tp = join_tp_group(job.rendezvous, rank, job.tp, device)
    _measure(rank, job, tp, device, copy_bytes_per_s)
    end_rank()


def _measure(
    rank: int, job: RankJob, tp: TPRank, device: torch.device, copy_bytes_per_s: float | None
) -> None:
    leader = rank == 0
    label = f"{job.model} TP {job.tp}"
    t0 = time.perf_counter()
    runner = ModelRunner(
        job.path,
        load_format="dummy",
        device=device,
        num_blocks=job.num_blocks,
        block_size=BLOCK_SIZE,
        max_num_seqs=max(job.batch_sizes),
        tp=tp,
        cuda_graph_batch_sizes=job.batch_sizes,
        compile_model=job.compile_model,
        enforce_eager=job.enforce_eager,
    )
    build_s = time.perf_counter() - t0
    runner._kv_storage.normal_()  # random K/V: never time on zeros
    spec = runner.spec
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    compiled, graphs = is_compiled(runner.model), runner.cuda_graphs is not None
    if leader:
        log(f"{label}: runner built in {build_s:.1f} s (compiled {compiled}, graphs {graphs})")
    header: dict[str, Any] = {
        "build_s": round(build_s, 1),
        "copy_GBps": None if copy_bytes_per_s is None else copy_bytes_per_s / 1e9,
        "rows": [],
    }
    rng = random.Random(0)  # the same seed on every rank: the same batches
    for n in job.batch_sizes:
        batch = decode_batch(n, job.context, runner.num_blocks, spec.vocab_size, rng)
        _barrier(tp)
        step_ms = time_stats(wall_times(lambda b=batch: runner.execute(b), job.steps, job.warmup))
        kv_bytes = n * job.context * spec.kv_bytes_per_token  # this rank's KV heads
        row: dict[str, Any] = {
            "model": job.model,
            "tp": job.tp,
            "batch": n,
            "context": job.context,
            "compiled": compiled,
            "graphs": graphs,
            "step_ms": step_ms,
            "weight_bytes": weight_bytes,
            "kv_bytes": kv_bytes,
            "build_s": header["build_s"],
        }
        if runner.cuda_graphs is not None:
            row["graph_gpu_ms"] = _graph_replay_ms(runner.cuda_graphs, batch, job.steps)
        if copy_bytes_per_s is not None:
            floor_ms = (weight_bytes + kv_bytes) / copy_bytes_per_s * 1e3
            row["floor_ms"] = floor_ms
            row["step_over_floor"] = step_ms["median"] / floor_ms
        if tp.size > 1:
            _barrier(tp)
            row.update(_all_reduce_times(n, spec.hidden_size, runner.dtype, tp, device, job))
            one_ms = row.get("all_reduce_graph_us", row["all_reduce_us"])["median"] / 1e3
            row["all_reduces_per_step"] = ALL_REDUCES_PER_LAYER * spec.num_layers
            row["all_reduce_share"] = row["all_reduces_per_step"] * one_ms / step_ms["median"]
        if leader:
            header["rows"].append(row)
            _write_atomic(Path(job.out), header)
            log(f"{label} batch {n}: step {step_ms['median']:.3f} ms")


def _graph_replay_ms(graphs: DecodeGraphs, batch: Batch, reps: int) -> dict[str, float]:
    """GPU time of the step's graph alone (no host work), as the last step left its
    inputs; every rank replays its own in lockstep."""
    size = next(s for s in graphs.batch_sizes if s >= len(batch.seqs))
    return time_stats(event_times(graphs._graphs[size][0].replay, reps))


def _barrier(tp: TPRank) -> None:
    """Start a timed part together: the first collective must not time a late rank."""
    if tp.size > 1:
        dist.barrier()


def _all_reduce_times(
    n: int, hidden: int, dtype: torch.dtype, tp: TPRank, device: torch.device, job: RankJob
) -> dict[str, Any]:
    """Microseconds of one all-reduce of a [n, hidden] tensor of the model's dtype on the
    group: launched one by one, and (CUDA) replayed from a captured graph."""
    x = torch.randn(n, hidden, device=device).to(dtype)
    calls = ALL_REDUCES_PER_SAMPLE

    def several() -> None:
        for _ in range(calls):
            all_reduce(x, tp)

    def per_call_us(ms: list[float]) -> dict[str, float]:
        return time_stats([t * 1e3 / calls for t in ms])

    if device.type != "cuda":
        return {"all_reduce_us": per_call_us(wall_times(several, job.all_reduce_reps))}
    out: dict[str, Any] = {"all_reduce_us": per_call_us(event_times(several, job.all_reduce_reps))}
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            several()
        _barrier(tp)
        out["all_reduce_graph_us"] = per_call_us(event_times(graph.replay, job.all_reduce_reps))
    except Exception as exc:  # keep the step's and the eager numbers
        out["all_reduce_graph_error"] = repr(exc)
    return out


def _write_atomic(path: Path, record: dict[str, Any]) -> None:
    """A reader never sees half a file (the driver reads it after a killed rank too)."""
    part = path.with_suffix(".part")
    part.write_text(json.dumps(record))
    os.replace(part, path)


# ---------------------------------------------------------------- the driver

# NVLink multicast (NVLS) can take a shared host's GPUs down: off in every rank.
NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
# What a rank holds besides its weights and KV: the compiler's and cuBLAS's workspaces,
# the graphs' pool, NCCL's buffers, one full-size tensor while random weights are drawn.
HEADROOM_BYTES = 8 << 30


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
    out = args.out or (device_out() or REPO / "bench" / "results") / "tp_decode.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    use_cuda = args.device == "cuda"
    os.environ.update(NO_MULTICAST)  # the ranks inherit it
    gpu_bytes = torch.cuda.get_device_properties(0).total_memory if use_cuda else None
    result: dict[str, Any] = {
        "provenance": provenance("bench.tp_decode", argv),
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

    def num(row: dict[str, Any], key: str, spec: str) -> str:
        value = row.get(key)
        value = value["median"] if isinstance(value, dict) else value
        return "" if value is None else f"{value:{spec}}"

    cells = (("step_ms", ".3f"), ("graph_gpu_ms", ".3f"), ("floor_ms", ".3f"),
             ("step_over_floor", ".2f"), ("vs_tp1", ".2f"), ("all_reduce_us", ".1f"),
             ("all_reduce_graph_us", ".1f"), ("all_reduce_share", ".1%"))  # fmt: skip
    rows = [
        [r["model"], r["tp"], r["batch"], *(num(r, k, s) for k, s in cells)] for r in result["rows"]
    ]
    head = ["model", "tp", "batch", "step", "gpu", "floor", "×floor", "÷TP1", "AR", "AR graph"]
    print("\n".join(text_table([*head, "AR share"], rows)))
    for text in result["notes"] + result["errors"]:
        print(f"  {text}")


if __name__ == "__main__":
    sys.exit(main())
