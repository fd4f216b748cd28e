"""Offline throughput: pdserve's engine (continuous batching) vs static-batch `generate()`.

Both systems get the same N requests: random prompt token ids (no special tokens) and
output lengths drawn uniformly from the given ranges with a fixed seed, greedy, with EOS
ignored so every request produces exactly its requested number of tokens. Concurrency is
equal: the baseline runs the requests in order in static batches of `--batch-size`, and the
engine schedules with `max_num_seqs = --batch-size`.

A static batch runs until its longest member finishes, so the baseline's useful output is
the sum of the *requested* output lengths (not `batch_size * max_new_tokens`). The metric
for both systems is useful output tokens / wall seconds. Example:

    python -m bench.offline --num-requests 32 --prompt-len 16:128 --output-len 8:256 \\
        --batch-size 8 --out bench/results/offline.json --check-ratio 1.5

Not a test: timings depend on the machine and on whatever else shares its CPU.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from bench.report import git_commit as git_commit  # bench.gpu_suite imports it here
from bench.report import percentile, provenance

if TYPE_CHECKING:
    from engine.core.batch import Batch
    from engine.llm import LLM

DEFAULT_OUT = Path("bench/results/offline.json")


def parse_range(text: str) -> tuple[int, int]:
    """'16:128' -> (16, 128); '64' -> (64, 64)."""
    low, _, high = text.partition(":")
    try:
        lo, hi = int(low), int(high or low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX integers, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX with 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


# ---------------------------------------------------------------- workload


@dataclass(frozen=True)
class Workload:
    """The requests both systems run: prompt token ids and exact output lengths."""

    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(
    tokenizer: Any,
    vocab_size: int,
    num_requests: int,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    seed: int,
) -> Workload:
    """Random prompts over the non-special token ids, lengths uniform in the given ranges."""
    rng = random.Random(seed)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    special |= set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    limit = min(vocab_size, len(tokenizer)) if tokenizer is not None else vocab_size
    pool = [t for t in range(limit) if t not in special]
    prompts = [
        [rng.choice(pool) for _ in range(rng.randint(*prompt_len))] for _ in range(num_requests)
    ]
    output_lens = [rng.randint(*output_len) for _ in range(num_requests)]
    return Workload(prompts, output_lens)


# ---------------------------------------------------------------- results


@dataclass
class SystemResult:
    """Timing of one system over the whole workload."""

    system: str
    requests: int
    output_tokens: int  # useful tokens: the sum of requested output lengths
    wall_s: float
    forward_steps: int  # forward passes (a static batch's prefill + its decode steps)
    computed_output_tokens: int = 0  # tokens generated including padding rows' waste
    # CPU seconds this process used (all threads). cpu_s / wall_s well below the torch
    # thread count means the cores were shared; near it proves little (OpenMP threads
    # spin while they wait), so the load averages are recorded too.
    cpu_s: float = 0.0
    loadavg_before: list[float] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list, repr=False)
    # Baseline only: (seconds, batch rows, query tokens per row) of every forward pass.
    forwards: list[tuple[float, int, int]] = field(default_factory=list, repr=False)

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else float("nan")

    def summary(self, baseline: SystemResult | None) -> dict[str, Any]:
        ratio = self.output_tok_s / baseline.output_tok_s if baseline is not None else 1.0
        # Same ratio over process CPU seconds: with --threads 1 (no OpenMP spinning) it
        # measures work done and is far less sensitive to other processes than wall time.
        cpu_ratio = baseline.cpu_s / self.cpu_s if baseline is not None and self.cpu_s > 0 else 1.0
        return {
            "system": self.system,
            "requests": self.requests,
            "output_tokens": self.output_tokens,
            "computed_output_tokens": self.computed_output_tokens,
            "wall_s": round(self.wall_s, 4),
            "output_tok_s": round(self.output_tok_s, 3),
            "ratio_vs_baseline": round(ratio, 4),
            "forward_steps": self.forward_steps,
            "mean_step_ms": round(1000 * self.wall_s / max(self.forward_steps, 1), 3),
            "process_cpu_s": round(self.cpu_s, 3),
            "cpu_time_ratio_vs_baseline": round(cpu_ratio, 4),
            "cpu_utilisation": round(self.cpu_s / self.wall_s, 3) if self.wall_s > 0 else None,
            "loadavg_before": self.loadavg_before,
        }


@dataclass
class StepRecord:
    """One engine step: its time, the runner's share of it, and the batch's shape."""

    step_s: float
    execute_s: float = 0.0
    num_seqs: int = 0
    num_tokens: int = 0
    num_prefill_seqs: int = 0  # sequences with more than one query token this step
    max_context: int = 0  # longest sequence (tokens in the cache after this step)


@dataclass
class StepProfile:
    """Counts every `llm.core.step` and `llm.runner.execute` (or `launch`) call while
    installed. With async scheduling a step launches one batch and waits for the one
    before, so its time is the interval between steps, and `execute_s` is the launch."""

    records: list[StepRecord] = field(default_factory=list)
    _pending_execute: tuple[float, Batch] | None = None

    def install(self, llm: LLM) -> Callable[[], None]:
        """Wrap the step and execute methods of this LLM; returns a function that unwraps."""
        core, runner = llm.core, llm.runner
        orig_step, orig_execute = core.step, runner.execute
        orig_launch = getattr(runner, "launch", None)

        def execute(batch: Batch) -> dict[str, int]:
            t0 = time.perf_counter()
            out = orig_execute(batch)
            self._pending_execute = (time.perf_counter() - t0, batch)
            return out

        def launch(batch: Batch, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = orig_launch(batch, **kwargs)  # type: ignore[misc]
            self._pending_execute = (time.perf_counter() - t0, batch)
            return out

        def step() -> Any:
            self._pending_execute = None
            t0 = time.perf_counter()
            out = orig_step()
            rec = StepRecord(time.perf_counter() - t0)
            if self._pending_execute is not None:
                rec.execute_s, batch = self._pending_execute
                rec.num_seqs = len(batch.seqs)
                rec.num_tokens = batch.num_tokens
                rec.num_prefill_seqs = sum(1 for s in batch.seqs if s.num_tokens > 1)
                rec.max_context = max(s.end_position for s in batch.seqs)
            self.records.append(rec)
            return out

        core.step = step  # type: ignore[method-assign]
        runner.execute = execute  # type: ignore[method-assign]
        if orig_launch is not None:
            runner.launch = launch

        def uninstall() -> None:
            del core.step, runner.execute  # back to the class methods
            if orig_launch is not None:
                del runner.launch

        return uninstall

    def summary(self, wall_s: float) -> dict[str, Any]:
        """Aggregates in milliseconds; `outside_step_s` is LLM.generate's own overhead."""
        recs = [r for r in self.records if r.num_seqs > 0]
        decode = [r for r in recs if r.num_prefill_seqs == 0]
        mixed = [r for r in recs if r.num_prefill_seqs > 0]
        step_total = sum(r.step_s for r in self.records)
        execute_total = sum(r.execute_s for r in recs)

        def ms(values: Sequence[float]) -> float:
            return round(1000 * statistics.fmean(values), 3) if values else 0.0

        return {
            "steps": len(self.records),
            "non_empty_steps": len(recs),
            "mean_step_ms": ms([r.step_s for r in self.records]),
            "median_step_ms": _pct_ms([r.step_s for r in recs], 50),
            "p90_step_ms": _pct_ms([r.step_s for r in recs], 90),
            "p99_step_ms": _pct_ms([r.step_s for r in recs], 99),
            "max_step_ms": _pct_ms([r.step_s for r in recs], 100),
            "mean_execute_ms": ms([r.execute_s for r in recs]),
            "mean_schedule_update_ms": ms([r.step_s - r.execute_s for r in recs]),
            "decode_only_steps": len(decode),
            "decode_only_mean_step_ms": ms([r.step_s for r in decode]),
            "decode_only_mean_seqs": round(statistics.fmean(r.num_seqs for r in decode), 3)
            if decode
            else 0.0,
            "steps_with_prefill": len(mixed),
            "steps_with_prefill_mean_ms": ms([r.step_s for r in mixed]),
            "steps_with_prefill_mean_tokens": round(
                statistics.fmean(r.num_tokens for r in mixed), 1
            )
            if mixed
            else 0.0,
            "mean_seqs_per_step": round(statistics.fmean(r.num_seqs for r in recs), 3)
            if recs
            else 0.0,
            "step_total_s": round(step_total, 4),
            "execute_total_s": round(execute_total, 4),
            "outside_step_s": round(wall_s - step_total, 4),
            # One row per step: [ms, seqs, tokens, prefill seqs, longest context].
            "per_step": [
                [
                    round(1000 * r.step_s, 2),
                    r.num_seqs,
                    r.num_tokens,
                    r.num_prefill_seqs,
                    r.max_context,
                ]
                for r in self.records
            ],
        }


def _pct_ms(values: Sequence[float], pct: float) -> float:
    """The `pct` percentile (bench.report's definition) of `values` seconds, in ms."""
    if not values:
        return 0.0
    return round(1000 * percentile(values, pct), 3)


# ---------------------------------------------------------------- systems


def load_baseline_model(path: Path, dtype: torch.dtype, device: torch.device) -> Any:
    """The same weights as the engine's, through plain transformers (default attention)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    model = model.to(device)  # type: ignore[arg-type]
    model.eval()
    model.requires_grad_(False)
    return model


@torch.inference_mode()
def run_baseline(
    model: Any,
    tokenizer: Any,
    workload: Workload,
    batch_size: int,
    device: torch.device,
) -> SystemResult:
    """Requests in order, in static left-padded batches, each run to its longest member."""
    tokenizer.padding_side = "left"
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        pad_id = tokenizer.eos_token_id
    outputs: list[list[int]] = []
    steps = computed = 0
    forwards: list[tuple[float, int, int]] = []
    started: list[float] = []

    def before(_module: Any, _args: Any, kwargs: dict[str, Any]) -> None:
        started.append(time.perf_counter())

    def after(_module: Any, _args: Any, kwargs: dict[str, Any], _out: Any) -> None:
        _sync(device)
        rows, width = kwargs["input_ids"].shape
        forwards.append((time.perf_counter() - started.pop(), int(rows), int(width)))

    hooks = [
        model.register_forward_pre_hook(before, with_kwargs=True),
        model.register_forward_hook(after, with_kwargs=True),
    ]
    load = _loadavg()
    _sync(device)
    c0, t0 = time.process_time(), time.perf_counter()
    for start in range(0, len(workload.prompts), batch_size):
        prompts = workload.prompts[start : start + batch_size]
        lens = workload.output_lens[start : start + batch_size]
        max_new = max(lens)
        enc = tokenizer.pad(
            {"input_ids": prompts}, padding=True, return_tensors="pt", padding_side="left"
        )
        input_ids = enc["input_ids"].to(device)
        seqs = model.generate(
            input_ids=input_ids,
            attention_mask=enc["attention_mask"].to(device),
            max_new_tokens=max_new,
            min_new_tokens=max_new,  # EOS cannot end the batch early
            do_sample=False,
            pad_token_id=pad_id,
        )
        new = seqs[:, input_ids.shape[1] :].tolist()
        if any(len(row) != max_new for row in new):
            raise RuntimeError(f"generate() returned {len(new[0])} tokens, asked {max_new}")
        outputs.extend(row[:n] for row, n in zip(new, lens, strict=True))
        steps += max_new  # one prefill forward (yields token 1) + max_new - 1 decode steps
        computed += max_new * len(prompts)
    _sync(device)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    for hook in hooks:
        hook.remove()
    return SystemResult(
        system="hf-generate-static",
        requests=len(workload.prompts),
        output_tokens=workload.num_output_tokens,
        wall_s=wall,
        forward_steps=steps,
        computed_output_tokens=computed,
        cpu_s=cpu,
        loadavg_before=load,
        outputs=outputs,
        forwards=forwards,
    )


def step_costs(
    baseline: SystemResult | None, profile: StepProfile, batch_size: int
) -> dict[str, Any]:
    """Decode and prefill step costs of both systems, in milliseconds, side by side.

    The engine's decode step is compared at a full batch (`batch_size` sequences) where it
    has such steps; the baseline's decode forwards always run `batch_size` rows (fewer only
    in a last, partial batch).
    """

    def ms(values: Sequence[float]) -> float | None:
        return round(1000 * statistics.median(values), 2) if values else None

    recs = [r for r in profile.records if r.num_seqs > 0]
    decode = [r for r in recs if r.num_prefill_seqs == 0]
    full = [r.step_s for r in decode if r.num_seqs == batch_size]
    out: dict[str, Any] = {
        "engine_decode_step_ms_full_batch": ms(full),
        "engine_decode_steps_full_batch": len(full),
        "engine_decode_step_ms_any_batch": ms([r.step_s for r in decode]),
        "engine_step_with_prefill_ms": ms([r.step_s for r in recs if r.num_prefill_seqs > 0]),
    }
    if baseline is not None:
        fw = baseline.forwards
        dec = [t for t, rows, width in fw if width == 1 and rows == batch_size]
        out["baseline_decode_forward_ms"] = ms(dec)
        out["baseline_decode_forwards"] = len(dec)
        out["baseline_prefill_forward_ms"] = ms([t for t, _, width in fw if width > 1])
        eng, base = out["engine_decode_step_ms_full_batch"], out["baseline_decode_forward_ms"]
        out["decode_step_ratio_engine_vs_baseline"] = (
            round(eng / base, 3) if eng is not None and base else None
        )
    return out


def run_engine(
    llm: LLM, workload: Workload, device: torch.device
) -> tuple[SystemResult, StepProfile]:
    """All requests submitted at once to `llm.generate` (continuous batching)."""
    from engine.sampling_params import SamplingParams

    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in workload.output_lens
    ]
    profile = StepProfile()
    uninstall = profile.install(llm)
    load = _loadavg()
    try:
        _sync(device)
        c0, t0 = time.process_time(), time.perf_counter()
        results = llm.generate(workload.prompts, params)
        _sync(device)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        uninstall()
    outputs = [list(r.token_ids) for r in results]
    for i, (out, n) in enumerate(zip(outputs, workload.output_lens, strict=True)):
        if len(out) != n:
            raise RuntimeError(f"engine request {i}: {len(out)} tokens, asked {n}")
    result = SystemResult(
        system="pdserve-engine",
        requests=len(workload.prompts),
        output_tokens=sum(len(o) for o in outputs),
        wall_s=wall,
        forward_steps=len(profile.records),
        computed_output_tokens=sum(len(o) for o in outputs),
        cpu_s=cpu,
        loadavg_before=load,
        outputs=outputs,
    )
    return result, profile


def _loadavg() -> list[float]:
    """1, 5 and 15 minute load averages (empty where the OS has none)."""
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else []


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def agreement(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> dict[str, float]:
    """How far two systems' greedy outputs agree (informational: padding and batch shape
    change float rounding, and the baseline's min_new_tokens masks EOS, so ties can flip)."""
    exact = sum(1 for x, y in zip(a, b, strict=True) if list(x) == list(y))
    prefix = []
    for x, y in zip(a, b, strict=True):
        k = 0
        while k < min(len(x), len(y)) and x[k] == y[k]:
            k += 1
        prefix.append(k / max(len(x), 1))
    return {
        "exact_match_requests": exact,
        "mean_common_prefix_fraction": round(statistics.fmean(prefix), 4) if prefix else 0.0,
    }


# ---------------------------------------------------------------- report


def machine_info(device: torch.device) -> dict[str, Any]:
    """What the provenance record does not say and these numbers depend on."""
    info: dict[str, Any] = {
        "torch_num_threads": torch.get_num_threads(),
        "device": str(device),
    }
    if device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(device)
    return info


def format_table(rows: list[dict[str, Any]]) -> str:
    """A fixed-width table of the per-system summaries."""
    header = ("system", "requests", "output tokens", "wall s", "output tok/s", "vs baseline")
    body = [
        (
            r["system"],
            str(r["requests"]),
            str(r["output_tokens"]),
            f"{r['wall_s']:.2f}",
            f"{r['output_tok_s']:.1f}",
            f"{r['ratio_vs_baseline']:.2f}x",
        )
        for r in rows
    ]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(header)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    lines = [line(header), *(line(b) for b in body)]
    return "\n".join(lines)


# ---------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.offline",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("--model", default=None, help="HF model folder (default: embedded SmolLM2)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    p.add_argument(
        "--dtype",
        default=None,
        choices=("float32", "bfloat16", "float16"),
        help="default: float32 on CPU, bfloat16 on CUDA (the engine's own default)",
    )
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prompt-len", type=parse_range, default=(16, 128), metavar="MIN:MAX")
    p.add_argument("--output-len", type=parse_range, default=(8, 256), metavar="MIN:MAX")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--batch-size",
        type=int,
        default=8,
        help="static batch size of the baseline = the engine's max_num_seqs",
    )
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: torch's choice). On a CPU shared with other "
        "busy processes, 1 avoids OpenMP barrier stalls that make timings erratic",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results file")
    p.add_argument(
        "--check-ratio",
        type=float,
        default=None,
        metavar="X",
        help="exit 1 if engine tok/s / baseline tok/s < X",
    )
    p.add_argument("--skip-baseline", action="store_true", help="time the engine only (no ratio)")
    p.add_argument(
        "--cprofile",
        type=Path,
        default=None,
        metavar="FILE",
        help="after timing, run the engine once more under cProfile and dump stats to FILE",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.num_requests < 1 or args.batch_size < 1:
        print("--num-requests and --batch-size must be >= 1", file=sys.stderr)
        return 2
    if args.skip_baseline and args.check_ratio is not None:
        print("--check-ratio needs the baseline", file=sys.stderr)
        return 2

    from engine.core.config import SchedulerConfig
    from engine.factory import EngineArgs
    from engine.llm import LLM
    from engine.model.model_loader import load_tokenizer, resolve_dtype
    from engine.sampling_params import SamplingParams

    if args.threads is not None:
        if args.threads < 1:
            print("--threads must be >= 1", file=sys.stderr)
            return 2
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    machine = machine_info(device)
    machine["loadavg_at_start"] = _loadavg()
    dtype = resolve_dtype(args.dtype, device)
    if args.model is None:
        from engine.model.embedded import ensure_embedded_model

        model_path = ensure_embedded_model()
    else:
        model_path = Path(args.model)

    print(f"loading {model_path} ({dtype}, {device}) ...", file=sys.stderr)
    llm = LLM(
        EngineArgs(
            model=str(model_path),
            dtype=args.dtype,
            device=str(device),
            kv_cache_gib=args.kv_cache_gib,
            scheduler=SchedulerConfig(max_num_seqs=args.batch_size),
        )
    )
    tokenizer = load_tokenizer(model_path)  # the baseline's own copy (padding side changes)
    workload = make_workload(
        tokenizer,
        llm.spec.vocab_size,
        args.num_requests,
        args.prompt_len,
        args.output_len,
        args.seed,
    )
    print(
        f"workload: {args.num_requests} requests, {workload.num_prompt_tokens} prompt tokens, "
        f"{workload.num_output_tokens} output tokens, batch size {args.batch_size}",
        file=sys.stderr,
    )

    warm = Workload([workload.prompts[0][:8]], [4])
    rows: list[dict[str, Any]] = []
    baseline: SystemResult | None = None
    if not args.skip_baseline:
        model = load_baseline_model(model_path, dtype, device)
        run_baseline(model, tokenizer, warm, args.batch_size, device)
        print("timing baseline (transformers generate, static batches) ...", file=sys.stderr)
        baseline = run_baseline(model, tokenizer, workload, args.batch_size, device)
        del model  # free its memory before the engine runs
        rows.append(baseline.summary(None))

    llm.generate([warm.prompts[0]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    print("timing engine (continuous batching) ...", file=sys.stderr)
    engine_result, profile = run_engine(llm, workload, device)
    step_profile = profile.summary(engine_result.wall_s)
    rows.append(engine_result.summary(baseline))

    print()
    print(format_table(rows))
    print()
    for r in rows:
        print(
            f"{r['system']}: process CPU {r['process_cpu_s']:.1f} s over {r['wall_s']:.1f} s wall "
            f"= {r['cpu_utilisation']:.2f} cores busy, CPU-time ratio vs baseline "
            f"{r['cpu_time_ratio_vs_baseline']:.2f}x (torch threads {torch.get_num_threads()}, "
            f"load average before {r['loadavg_before']})"
        )
    sp = step_profile
    print(
        f"engine steps: {sp['steps']} (mean {sp['mean_step_ms']:.1f} ms, median "
        f"{sp['median_step_ms']:.1f} ms, p90 {sp['p90_step_ms']:.1f} ms, max "
        f"{sp['max_step_ms']:.0f} ms; runner.execute {sp['mean_execute_ms']:.1f} ms, "
        f"schedule+update {sp['mean_schedule_update_ms']:.2f} ms); "
        f"decode-only {sp['decode_only_steps']} x {sp['decode_only_mean_step_ms']:.1f} ms "
        f"at {sp['decode_only_mean_seqs']:.2f} seqs, "
        f"with prefill {sp['steps_with_prefill']} x {sp['steps_with_prefill_mean_ms']:.1f} ms; "
        f"outside steps {sp['outside_step_s']:.2f} s"
    )
    costs = step_costs(baseline, profile, args.batch_size)
    print(
        "step costs (median ms): decode at batch "
        f"{args.batch_size}: engine {costs['engine_decode_step_ms_full_batch']} "
        f"(a whole step: schedule, forward, sample, update; "
        f"{costs['engine_decode_steps_full_batch']} steps) vs transformers forward "
        f"{costs.get('baseline_decode_forward_ms')} "
        f"({costs.get('baseline_decode_forwards', 0)} forwards), ratio "
        f"{costs.get('decode_step_ratio_engine_vs_baseline')}; prompt steps: engine "
        f"{costs['engine_step_with_prefill_ms']} (prompt chunks + running decodes) vs "
        f"transformers {costs.get('baseline_prefill_forward_ms')} (a padded batch of prompts)"
    )
    agree = None
    if baseline is not None:
        b = rows[0]
        print(
            f"baseline forward passes: {b['forward_steps']} (mean {b['mean_step_ms']:.1f} ms "
            f"each), {b['computed_output_tokens']} tokens computed for "
            f"{b['output_tokens']} useful"
        )
        agree = agreement(baseline.outputs, engine_result.outputs)
        print(
            f"greedy agreement: {agree['exact_match_requests']}/{args.num_requests} identical, "
            f"mean common prefix {agree['mean_common_prefix_fraction']:.1%}"
        )

    ratio = rows[-1]["ratio_vs_baseline"] if baseline is not None else None
    report = {
        "provenance": provenance("bench.offline", sys.argv[1:] if argv is None else argv),
        "machine": machine,
        "params": {
            "model": str(model_path),
            "dtype": str(dtype).removeprefix("torch."),
            "device": str(device),
            "num_requests": args.num_requests,
            "prompt_len": list(args.prompt_len),
            "output_len": list(args.output_len),
            "seed": args.seed,
            "batch_size": args.batch_size,
            "kv_cache_gib": args.kv_cache_gib,
            "threads": torch.get_num_threads(),
            "num_kv_blocks": llm.runner.num_blocks,
            "ignore_eos": True,
            "temperature": 0.0,
        },
        "workload": {
            "prompt_tokens": workload.num_prompt_tokens,
            "output_tokens": workload.num_output_tokens,
            "prompt_lens": [len(p) for p in workload.prompts],
            "output_lens": workload.output_lens,
        },
        "results": rows,
        "engine_step_profile": step_profile,
        "step_costs": costs,
        "greedy_agreement": agree,
        "ratio": ratio,
        "check_ratio": args.check_ratio,
    }
    machine["loadavg_at_end"] = _loadavg()

    if args.cprofile is not None:
        print(f"profiling one more engine run into {args.cprofile} ...", file=sys.stderr)
        params = [
            SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            for n in workload.output_lens
        ]
        prof = cProfile.Profile()
        prof.runcall(llm.generate, workload.prompts, params)
        args.cprofile.parent.mkdir(parents=True, exist_ok=True)
        prof.dump_stats(str(args.cprofile))
        pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(25)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")

    if args.check_ratio is not None and ratio is not None and ratio < args.check_ratio:
        print(f"FAIL: engine/baseline = {ratio:.2f} < {args.check_ratio}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
