"""One rank of a `bench.tp_decode` configuration: build the runner, time decode steps and
the all-reduce alone, in lockstep with the other ranks; rank 0 writes the rows.

Every rank builds the same `ModelRunner` (its share of the model and of the KV heads),
fills its cache with random K/V and runs the same batches in the same order: each step's
collectives pair up across the ranks, so no rank can run ahead by more than a step. The
batches are drawn from one fixed seed, so every rank draws the same ones.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bench.device import free
from bench.report import percentile
from engine.core.batch import Batch, ScheduledSeq
from engine.model.compiled import is_compiled
from engine.model.cuda_graphs import DecodeGraphs
from engine.model.model_runner import ModelRunner
from engine.parallel.tensor_parallel import TPRank, all_reduce, join_tp_group
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
    try:
        _measure(rank, job, tp, device, copy_bytes_per_s)
        # Every rank done before any tears the group down: gloo aborts a process whose
        # peer destroys the group while it still has a collective in flight.
        if dist.is_initialized():
            dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


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
