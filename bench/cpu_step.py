"""CPU decode step: a whole engine step against a transformers forward of the same batch.

One process, one model (default: the embedded SmolLM2-135M), float32 on CPU. Both prefill
the same `--batch-size` random prompts; then, round after round, the engine's core takes
one step (`EngineCore.step`: everything a served decode step costs the host) and
transformers runs one decode forward on its `DynamicCache`, each feeding its own greedy
token; `--context` is the context of the middle round, and the side that goes first
alternates. The engine's step is also taken apart (schedule / metadata / forward /
sample / update / the rest), and each side's process CPU time kept (with `--threads 1`,
the work done, whatever shares the cores). The engine's float32 linear layers run in
oneDNN (engine.model.cpu_linear), transformers' in torch's sgemm; `--sgemm` runs the
engine's in sgemm too, leaving the engine's own costs as the difference. Example:

    python -m bench.cpu_step --cpus 2,3 --rounds 200 --out bench/results/cpu_step.json \\
        --max-ratio 1.0
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from unittest import mock

import torch

from bench.report import distribution, write_result
from bench.suite_common import make_prompts

if TYPE_CHECKING:
    from engine.llm import LLM

DEFAULT_OUT = Path("bench/results/cpu_step.json")
# The mean context of the decode tokens of the CPU comparison's workload (32 requests,
# prompts of 16-128 and outputs of 8-256 tokens drawn uniformly, seed 0): a request of
# p prompt and o output tokens decodes o - 1 of them, at contexts p + 1 .. p + o - 1.
DEFAULT_CONTEXT = 163
PHASES = ("schedule", "metadata", "forward", "sample", "update", "other")


def parse_cpus(text: str) -> set[int]:
    """'2,3' or '0-3' or '0,4-5' -> a set of CPU numbers."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            low, _, high = part.strip().partition("-")
            cpus.update(range(int(low), int(high or low) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected CPU numbers like 2,3 or 0-3, got {text!r}"
        ) from None
    if not cpus or min(cpus) < 0:
        raise argparse.ArgumentTypeError(f"expected CPU numbers like 2,3 or 0-3, got {text!r}")
    return cpus


def parse_context(text: str) -> int:
    """A context of at least 2 tokens (a prompt token and the decoded one)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a token count, got {text!r}") from None
    if value < 2:
        raise argparse.ArgumentTypeError(f"a context needs at least 2 tokens, got {value}")
    return value


def load_transformers_model(path: Path, dtype: torch.dtype) -> Any:
    """The same weights as the engine's, through plain transformers (its default
    attention), on CPU, for inference."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    model.eval()
    model.requires_grad_(False)
    return model


# ---------------------------------------------------------------- the engine's side


@dataclass
class PhaseTimes:
    """Seconds of each phase of the step being timed; `other` is computed at the end."""

    seconds: dict[str, float] = field(default_factory=dict)

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def close(self, step_s: float) -> dict[str, float]:
        """The phases of a step of `step_s` seconds, the rest as `other`; then reset."""
        out = {p: self.seconds.get(p, 0.0) for p in PHASES[:-1]}
        out["other"] = step_s - sum(out.values())
        self.seconds = {}
        return out


def _timed(fn: Callable[..., Any], phase: str, times: PhaseTimes) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times.add(phase, time.perf_counter() - t0)

    return wrapper


@contextmanager
def phase_timers(llm: LLM, times: PhaseTimes) -> Iterator[None]:
    """Time the phases of the engine's steps into `times` while inside: the scheduler's
    schedule and update, the runner's attention metadata, model forward and sampling
    (a clock read on each side of each: a few microseconds a step)."""
    from engine.model.attention_metadata import PagedAttentionMetadata

    core, runner = llm.core, llm.runner
    started: list[float] = []

    def before(*_: Any) -> None:
        started.append(time.perf_counter())

    def after(*_: Any) -> None:
        times.add("forward", time.perf_counter() - started.pop())

    with ExitStack() as stack:
        sched = core.scheduler
        for obj, name, phase in (
            (sched, "schedule", "schedule"),
            (sched, "update", "update"),
            (runner, "_sample", "sample"),
        ):
            stack.enter_context(
                mock.patch.object(obj, name, _timed(getattr(obj, name), phase, times))
            )
        build = _timed(PagedAttentionMetadata.build, "metadata", times)
        stack.enter_context(mock.patch.object(PagedAttentionMetadata, "build", build))
        for hook in (
            runner.model.register_forward_pre_hook(before),
            runner.model.register_forward_hook(after),
        ):
            stack.callback(hook.remove)
        yield


class EngineSide:
    """The engine's core with `len(prompts)` running requests, prefilled, that decode one
    token a step for as long as `max_tokens` allows."""

    def __init__(self, llm: LLM, prompts: Sequence[Sequence[int]], max_tokens: int) -> None:
        from engine.sampling_params import SamplingParams
        from engine.wire import GenerationInput

        self.core = llm.core
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.req_ids = [f"cpu-step-{i}" for i in range(len(prompts))]
        for req_id, prompt in zip(self.req_ids, prompts, strict=True):
            self.core.add_request(GenerationInput(req_id, tuple(prompt), params))
        self.tokens: dict[str, list[int]] = {r: [] for r in self.req_ids}
        while not all(self.tokens.values()):  # the prompts' steps: each gives a first token
            self._apply(self.core.step())

    def _apply(self, updates: Sequence[Any]) -> None:
        for upd in updates:
            self.tokens[upd.req_id].extend(upd.new_token_ids)
            if upd.finish_reason is not None:
                raise RuntimeError(f"{upd.req_id} finished ({upd.finish_reason}) mid-benchmark")

    def step(self) -> tuple[float, float]:
        """One engine step: its wall and process CPU seconds. Every request must gain
        exactly one token."""
        before = sum(len(t) for t in self.tokens.values())
        c0, t0 = time.process_time(), time.perf_counter()
        updates = self.core.step()
        elapsed = time.perf_counter() - t0, time.process_time() - c0
        self._apply(updates)
        gained = sum(len(t) for t in self.tokens.values()) - before
        if gained != len(self.req_ids):
            raise RuntimeError(f"a decode step gave {gained} tokens for {len(self.req_ids)}")
        return elapsed

    def abort(self) -> None:
        for req_id in self.req_ids:
            self.core.abort(req_id)


# ---------------------------------------------------------------- transformers' side


class TransformersSide:
    """A transformers model with a DynamicCache of the same prompts; each step is one
    decode forward of the batch (its greedy next token picked outside the timing)."""

    def __init__(self, model: Any, prompts: Sequence[Sequence[int]], device: torch.device) -> None:
        from transformers import DynamicCache

        self.model = model
        # The cache's keyword: `past_key_values`, `cache` in newer transformers (which
        # still takes the old name, through a deprecation shim on every call).
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            ids = torch.tensor(prompts, dtype=torch.long, device=device)
            out = model(input_ids=ids, use_cache=True, **{self.cache_kw: self.cache})
            self.next = out.logits[:, -1].argmax(-1)
        self.tokens: list[list[int]] = [[t] for t in self.next.tolist()]

    @torch.inference_mode()
    def step(self) -> tuple[float, float]:
        """One decode forward: its wall and process CPU seconds."""
        ids, kw = self.next[:, None], {self.cache_kw: self.cache}
        c0, t0 = time.process_time(), time.perf_counter()
        out = self.model(input_ids=ids, use_cache=True, **kw)
        elapsed = time.perf_counter() - t0, time.process_time() - c0
        self.next = out.logits[:, -1].argmax(-1)
        for row, token in zip(self.tokens, self.next.tolist(), strict=True):
            row.append(token)
        return elapsed


# ---------------------------------------------------------------- the run


@dataclass
class Round:
    """One timed round: each side's wall seconds and process CPU seconds (all threads;
    with one torch thread, the work done, whatever else runs on the machine)."""

    engine_s: float
    transformers_s: float
    engine_cpu_s: float
    transformers_cpu_s: float
    engine_first: bool
    phases: dict[str, float]

    @property
    def ratio(self) -> float:
        return self.engine_s / self.transformers_s


def run_rounds(
    engine: EngineSide,
    hf: TransformersSide,
    times: PhaseTimes,
    warmup: int,
    rounds: int,
) -> list[Round]:
    """`warmup` untimed rounds, then `rounds` timed ones; the first side alternates."""
    out = []
    for r in range(warmup + rounds):
        engine_first = r % 2 == 0
        if engine_first:
            engine_s = engine.step()
            hf_s = hf.step()
        else:
            hf_s = hf.step()
            engine_s = engine.step()
        phases = times.close(engine_s[0])
        if r >= warmup:
            out.append(Round(engine_s[0], hf_s[0], engine_s[1], hf_s[1], engine_first, phases))
    return out


def summarise(rounds: Sequence[Round]) -> dict[str, Any]:
    """Medians per side, their ratio, the per-round ratios and the engine's phases (ms)."""
    engine = [r.engine_s for r in rounds]
    hf = [r.transformers_s for r in rounds]
    ratios = [r.ratio for r in rounds]
    phases = {
        p: {
            "median": 1000 * statistics.median(r.phases[p] for r in rounds),
            "mean": 1000 * statistics.fmean(r.phases[p] for r in rounds),
        }
        for p in PHASES
    }
    return {
        "engine_step_ms": distribution(engine, (10, 50, 90), scale=1000),
        "transformers_forward_ms": distribution(hf, (10, 50, 90), scale=1000),
        # The figure of merit: the median step over the median forward.
        "ratio": statistics.median(engine) / statistics.median(hf),
        "ratio_per_round": distribution(ratios, (10, 50, 90)),
        "engine_step_cpu_ms": distribution([r.engine_cpu_s for r in rounds], (50,), scale=1000),
        "transformers_forward_cpu_ms": distribution(
            [r.transformers_cpu_s for r in rounds], (50,), scale=1000
        ),
        # Process CPU time: with one torch thread the least sensitive to a shared machine.
        "cpu_ratio": statistics.median(r.engine_cpu_s for r in rounds)
        / statistics.median(r.transformers_cpu_s for r in rounds),
        "engine_first_ratio": _median_or_none([r.ratio for r in rounds if r.engine_first]),
        "transformers_first_ratio": _median_or_none(
            [r.ratio for r in rounds if not r.engine_first]
        ),
        "engine_phases_ms": phases,
        # [engine ms, transformers ms, ratio, engine CPU ms, transformers CPU ms]
        "rounds": [
            [
                round(1000 * r.engine_s, 3),
                round(1000 * r.transformers_s, 3),
                round(r.ratio, 4),
                round(1000 * r.engine_cpu_s, 3),
                round(1000 * r.transformers_cpu_s, 3),
            ]
            for r in rounds
        ],
    }


def _median_or_none(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def agreement(engine: EngineSide, hf: TransformersSide) -> float:
    """The share of positions where both systems' greedy tokens agree (informational:
    the two compute in different orders, so a near-tie can flip and the rest differ)."""
    same = total = 0
    for req_id, theirs in zip(engine.req_ids, hf.tokens, strict=True):
        ours = engine.tokens[req_id]
        n = min(len(ours), len(theirs))
        same += sum(1 for a, b in zip(ours[:n], theirs[:n], strict=True) if a == b)
        total += n
    return same / total if total else 0.0


def _linears(model: torch.nn.Module) -> str:
    from engine.model.cpu_linear import uses_onednn_linears

    return "onednn" if uses_onednn_linears(model) else "sgemm"


def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else []


def format_summary(result: dict[str, Any], batch: int, context: int) -> str:
    eng, hf = result["engine_step_ms"], result["transformers_forward_ms"]
    per = result["ratio_per_round"]
    ph = result["engine_phases_ms"]
    lines = [
        f"batch {batch}, context {context} (middle round), {len(result['rounds'])} rounds",
        f"engine step           median {eng['p50']:.2f} ms (p10 {eng['p10']:.2f}, "
        f"p90 {eng['p90']:.2f})",
        f"transformers forward  median {hf['p50']:.2f} ms (p10 {hf['p10']:.2f}, "
        f"p90 {hf['p90']:.2f})",
        f"ratio {result['ratio']:.3f} (per round: median {per['p50']:.3f}, p10 "
        f"{per['p10']:.3f}, p90 {per['p90']:.3f})",
        f"process CPU per step: engine {result['engine_step_cpu_ms']['p50']:.2f} ms, "
        f"transformers {result['transformers_forward_cpu_ms']['p50']:.2f} ms, ratio "
        f"{result['cpu_ratio']:.3f}",
    ]
    if ph is not None:
        lines.append(
            "engine step, median ms: "
            + ", ".join(f"{p} {ph[p]['median']:.3f}" for p in PHASES)
            + " (mean: "
            + ", ".join(f"{p} {ph[p]['mean']:.3f}" for p in PHASES)
            + ")"
        )
    lines.append("ratio per round: " + " ".join(f"{r[2]:.2f}" for r in result["rounds"]))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.cpu_step",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("--model", default=None, help="HF model folder (default: embedded SmolLM2)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument(
        "--context",
        type=parse_context,
        default=DEFAULT_CONTEXT,
        metavar="N",
        help="tokens attended at the middle round (default: the mean decode context of the "
        "CPU comparison's workload, 32 requests of 16-128 + 8-256 tokens)",
    )
    p.add_argument("--rounds", type=int, default=100, help="timed rounds")
    p.add_argument("--warmup", type=int, default=10, help="untimed rounds first")
    p.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: one per usable core)"
    )
    p.add_argument(
        "--cpus",
        type=parse_cpus,
        default=None,
        metavar="LIST",
        help="pin the process to these cores first (like taskset -c), e.g. 2,3 or 0-3",
    )
    p.add_argument("--seed", type=int, default=0, help="of the random prompts")
    p.add_argument(
        "--sgemm",
        action="store_true",
        help="the engine's linear layers in torch's sgemm, as transformers' (not oneDNN)",
    )
    p.add_argument(
        "--no-breakdown",
        action="store_true",
        help="time the engine's step without the phase clocks (no breakdown)",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results file")
    p.add_argument(
        "--max-ratio",
        type=float,
        default=None,
        metavar="X",
        help="exit 1 when the engine step's median over the forward's exceeds X",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.batch_size < 1 or args.rounds < 1 or args.warmup < 0:
        print("--batch-size and --rounds must be >= 1, --warmup >= 0", file=sys.stderr)
        return 2
    if args.cpus is not None:
        # Before torch starts its worker threads, which inherit the mask.
        os.sched_setaffinity(0, args.cpus)
    if args.threads is not None and args.threads < 1:
        print("--threads must be >= 1", file=sys.stderr)
        return 2
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = args.threads or usable or 1
    torch.set_num_threads(threads)

    from engine.core.config import SchedulerConfig
    from engine.factory import EngineArgs
    from engine.llm import LLM

    device = torch.device("cpu")
    dtype = getattr(torch, args.dtype)
    if args.model is None:
        from engine.model.embedded import ensure_embedded_model

        model_path = ensure_embedded_model()
    else:
        model_path = Path(args.model)
    load_start = _loadavg()
    print(f"loading {model_path} ({args.dtype}, {threads} threads) ...", file=sys.stderr)
    llm = LLM(
        EngineArgs(
            model=str(model_path),
            dtype=args.dtype,
            device="cpu",
            scheduler=SchedulerConfig(max_num_seqs=args.batch_size),
        )
    )
    if args.sgemm:
        from engine.model.cpu_linear import remove_onednn_linears

        remove_onednn_linears(llm.runner.model)
    context = args.context
    total = args.warmup + args.rounds
    # The first decode round attends prompt + 1 tokens; the middle timed one `context`.
    prompt_len = max(1, context - 1 - args.warmup - args.rounds // 2)
    if prompt_len + total + 1 > llm.spec.max_model_len:
        print(f"context {context} + {total} rounds exceeds the model's length", file=sys.stderr)
        return 2
    prompts = make_prompts(args.batch_size, prompt_len, llm.spec.vocab_size, args.seed)
    engine = EngineSide(llm, prompts, max_tokens=total + 2)
    hf = TransformersSide(load_transformers_model(model_path, dtype), prompts, device)

    times = PhaseTimes()
    print(f"timing {args.warmup} + {args.rounds} alternating rounds ...", file=sys.stderr)
    with ExitStack() as stack:
        if not args.no_breakdown:
            stack.enter_context(phase_timers(llm, times))
        rounds = run_rounds(engine, hf, times, args.warmup, args.rounds)
    agree = agreement(engine, hf)
    engine.abort()

    result = summarise(rounds)
    if args.no_breakdown:
        result["engine_phases_ms"] = None
    print(format_summary(result, args.batch_size, context))
    ratio = result["ratio"]
    passed = None if args.max_ratio is None else ratio <= args.max_ratio
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(
        args.out,
        "bench.cpu_step",
        argv,
        machine={
            "torch_threads": torch.get_num_threads(),
            "cpus": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "cpu_count": os.cpu_count(),
            "loadavg_at_start": load_start,
            "loadavg_at_end": _loadavg(),
        },
        params={
            "model": str(model_path),
            "dtype": args.dtype,
            "batch_size": args.batch_size,
            "context": context,
            "contexts": [prompt_len + args.warmup + 1, prompt_len + total],
            "rounds": args.rounds,
            "warmup": args.warmup,
            "seed": args.seed,
            "breakdown": not args.no_breakdown,
            "engine_linears": "sgemm" if args.sgemm else _linears(llm.runner.model),
            "num_kv_blocks": llm.runner.num_blocks,
        },
        **result,
        greedy_agreement=agree,
        max_ratio=args.max_ratio,
        passed=passed,
    )
    print(f"wrote {args.out}")
    if passed is False:
        print(f"FAIL: engine step / transformers forward = {ratio:.3f} > {args.max_ratio}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
