"""GPU suite, one-GPU parts, for one model shape in its own process (its memory goes back
to the driver when it exits): floor (the device's copy bandwidth), b (the engine
in-process, `engine.llm.LLM`, with per-step timings) and a (transformers `generate()`,
static batches of b's burst prompts), on the same random weights. Writes one JSON
(`--out`); `bench.gpu_suite` starts it and reads it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from bench.device import free, sync
from bench.report import int_list, provenance
from bench.suite_common import (
    KVGeometry,
    ReqTiming,
    RunSpec,
    add_run_args,
    error_record,
    make_prompts,
    plan_from_args,
    prompts_for,
    summarize,
)  # fmt: skip

if TYPE_CHECKING:
    from engine.core.batch import Batch
    from engine.llm import LLM

# ---------------------------------------------------------------- floor


def copy_bandwidth(device: torch.device, nbytes: int, iters: int = 20) -> dict[str, Any]:
    """Device-to-device copy; GB/s counts bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    sync(device)
    seconds = (time.perf_counter() - t0) / iters
    del src, dst
    free(device)
    return {
        "bytes": nbytes,
        "seconds": seconds,
        "read_write_gb_s": round(2 * nbytes / seconds / 1e9, 1),
    }


def weight_bytes_read_per_step(model: torch.nn.Module) -> int:
    """Parameter bytes a decode step reads: all of them, except an untied input embedding
    table (a step reads only its batch's rows of it)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    emb = model.get_input_embeddings().weight  # type: ignore[operator]
    out = model.get_output_embeddings()  # type: ignore[operator]
    if out is None or out.weight.data_ptr() != emb.data_ptr():
        total -= emb.numel() * emb.element_size()
    return total


# ---------------------------------------------------------------- b: pdserve engine


@dataclass
class StepRecord:
    """One engine step: its time, the runner's share of it, and the batch's shape."""

    step_s: float
    execute_s: float = 0.0
    num_seqs: int = 0
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
        orig_step = core.step
        wrapped = [name for name in ("execute", "launch") if hasattr(runner, name)]

        def timed(run: Callable[..., Any]) -> Callable[..., Any]:
            def call(batch: Batch, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                out = run(batch, **kwargs)
                self._pending_execute = (time.perf_counter() - t0, batch)
                return out

            return call

        def step() -> Any:
            self._pending_execute = None
            t0 = time.perf_counter()
            out = orig_step()
            rec = StepRecord(time.perf_counter() - t0)
            if self._pending_execute is not None:
                rec.execute_s, batch = self._pending_execute
                rec.num_seqs = len(batch.seqs)
                rec.num_prefill_seqs = sum(1 for s in batch.seqs if s.num_tokens > 1)
                rec.max_context = max(s.end_position for s in batch.seqs)
            self.records.append(rec)
            return out

        core.step = step  # type: ignore[method-assign]
        for name in wrapped:
            setattr(runner, name, timed(getattr(runner, name)))

        def uninstall() -> None:
            del core.step  # back to the class methods
            for name in wrapped:
                delattr(runner, name)

        return uninstall


def run_engine(
    ns: argparse.Namespace, device: torch.device, dtype: str, bandwidth: dict | None
) -> dict[str, Any]:
    from engine.core.config import SchedulerConfig
    from engine.factory import EngineArgs
    from engine.heap import freeze_startup_heap
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        EngineArgs(
            model=ns.model,
            load_format="dummy",
            device=str(device),
            dtype=dtype,
            kv_cache_gib=ns.kv_cache_gib,
            compile_model=not ns.no_compile,
            async_scheduling=True,
            **(
                {}
                if ns.prompt_graph_max_tokens is None
                else {"prompt_graph_max_tokens": ns.prompt_graph_max_tokens}
            ),
            scheduler=SchedulerConfig(max_num_seqs=max(128, *ns.concurrency)),
        )
    )
    startup_s = time.perf_counter() - t0
    geo = KVGeometry.of(Path(ns.model), torch.empty((), dtype=llm.runner.dtype).element_size())
    weight_bytes = weight_bytes_read_per_step(llm.runner.model)
    # Warm-up: the largest batch's prefill and a few decode steps, then one alone.
    warm = make_prompts(max(ns.concurrency), ns.prompt_len, geo.vocab_size, seed=99)
    llm.generate(warm, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    llm.generate(warm[:1], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    for length in sorted(set(ns.ttft_lens) - {ns.prompt_len}):  # first prompt of each length
        llm.generate(
            make_prompts(1, length, geo.vocab_size, seed=98),
            SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
        )
    # Warm, as a worker is before its first step: the same start-up heap, frozen, so
    # the baseline pays no full collection the service's workers do not.
    freeze_startup_heap()
    params = SamplingParams(max_tokens=ns.output_len, temperature=0.0, ignore_eos=True)
    runs = []
    for spec in plan_from_args(ns):
        profile = StepProfile()
        uninstall = profile.install(llm)
        try:
            prompts = prompts_for(ns.shape, spec, geo.vocab_size)
            timings, wall = closed_loop(llm, prompts, params, spec.concurrency)
        finally:
            uninstall()
        runs.append(
            summarize(
                "b_pdserve_engine",
                spec.concurrency,
                timings,
                wall,
                prompt_len=spec.prompt_len,
                rounds=spec.rounds,
                decode_step=decode_step_stats(
                    profile, spec.concurrency, weight_bytes, geo, bandwidth
                ),
            )
        )
    info = {
        "startup_s": round(startup_s, 2),
        "num_blocks": llm.runner.num_blocks,
        "cuda_graphs": getattr(llm.runner, "cuda_graphs", None) is not None,
        "weight_bytes_read_per_step": weight_bytes,
        "kv_bytes_per_token": geo.bytes_per_token,
        "runs": runs,
    }
    del llm
    free(device)
    return info


_run_ids = itertools.count()


def closed_loop(
    llm: Any, prompts: Sequence[Sequence[int]], params: Any, concurrency: int
) -> tuple[list[ReqTiming], float]:
    """Every prompt through the engine with at most `concurrency` in flight: a request
    that finishes is replaced by the next prompt at that step boundary, as a client that
    sends its next request on an answer would. Returns each request's timings (sent when
    queued) and the wall time to the last answer."""
    from engine.frontend.output_processor import OutputProcessor
    from engine.wire import GenerationInput

    core = llm.core
    outputs: dict[str, OutputProcessor] = {}
    timings = [ReqTiming(0.0) for _ in prompts]
    index_of: dict[str, int] = {}
    run = next(_run_ids)
    next_index = 0

    def admit(now: float) -> None:
        nonlocal next_index
        while next_index < len(prompts) and len(index_of) < concurrency:
            inp = GenerationInput(f"bench-{run}-{next_index}", tuple(prompts[next_index]), params)
            core.add_request(inp)
            outputs[inp.req_id] = OutputProcessor(llm.tokenizer, inp.prompt_token_ids, params.stop)
            index_of[inp.req_id] = next_index
            timings[next_index].sent_s = now
            next_index += 1

    start = time.perf_counter()
    admit(start)
    try:
        while index_of:
            for upd in core.step():
                i = index_of.get(upd.req_id)
                if i is None:
                    continue
                chunk, finish = outputs[upd.req_id].process(upd.new_token_ids, upd.finish_reason)
                if chunk is not None and chunk.token_ids:
                    timings[i].add_tokens(time.perf_counter(), len(chunk.token_ids))
                if finish is not None:
                    del index_of[upd.req_id], outputs[upd.req_id]
                    t = timings[i]
                    if t.num_tokens != params.max_tokens:
                        t.ok = False
                        t.error = f"{finish.name}: {t.num_tokens} tokens"
            admit(time.perf_counter())
        wall = time.perf_counter() - start
    finally:
        for req_id in index_of:  # an error leaves nothing behind in the engine
            core.abort(req_id)
    while core.has_unfinished:  # the step launched ahead (async scheduling), untimed
        core.step()
    return timings, wall


def decode_step_stats(
    profile: Any, batch: int, weight_bytes: int, geo: KVGeometry, bandwidth: dict | None
) -> dict[str, Any]:
    """Median full-batch decode-only step vs the memory floor (bytes read / copy bandwidth)."""
    steps = [r for r in profile.records if r.num_seqs == batch and r.num_prefill_seqs == 0]
    if not steps:
        return {"steps": 0}
    step_s = statistics.median(r.step_s for r in steps)
    exec_s = statistics.median(r.execute_s for r in steps)
    context = statistics.median(r.max_context for r in steps)
    kv_bytes = int(batch * context * geo.bytes_per_token)
    out: dict[str, Any] = {
        "steps": len(steps),
        "step_ms": round(step_s * 1000, 3),
        "execute_ms": round(exec_s * 1000, 3),
        "median_context": context,
        "bytes_read": weight_bytes + kv_bytes,
        "kv_bytes_read": kv_bytes,
    }
    if bandwidth:
        floor_s = (weight_bytes + kv_bytes) / (bandwidth["read_write_gb_s"] * 1e9)
        out["floor_ms"] = round(floor_s * 1000, 4)
        out["step_over_floor"] = round(step_s / floor_s, 2)
    return out


# ---------------------------------------------------------------- a: transformers


class _StepStamps:
    """A generate() streamer that only notes when each step's tokens reach the host."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # generate() first hands over the prompt
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


@torch.inference_mode()
def run_hf_static(model: Any, ns: argparse.Namespace, device: torch.device) -> list[dict]:
    """One batch of `concurrency` prompts (b's and c's burst) per concurrency."""
    vocab = model.config.vocab_size
    runs = []
    for c in ns.concurrency:
        prompts = prompts_for(ns.shape, RunSpec(c, 1, ns.prompt_len), vocab)
        ids = torch.tensor(prompts, device=device)
        mask = torch.ones_like(ids)
        kw = dict(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=0)
        model.generate(**kw, max_new_tokens=2, min_new_tokens=2)  # warm-up, same shapes
        stamps = _StepStamps()
        sync(device)
        start = time.perf_counter()
        out = model.generate(
            **kw, max_new_tokens=ns.output_len, min_new_tokens=ns.output_len, streamer=stamps
        )
        sync(device)
        wall = time.perf_counter() - start
        n = out.shape[1] - ids.shape[1]
        first, last = stamps.times[0], stamps.times[-1]
        timings = [ReqTiming(start, first_s=first, last_s=last, num_tokens=n) for _ in prompts]
        runs.append(summarize("a_hf_generate_static", c, timings, wall, steps=len(stamps.times)))
        del ids, mask, out
        free(device)
    return runs


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", required=True, help="name used in the report and the seeds")
    p.add_argument("--model", required=True, help="folder with config.json")
    p.add_argument("--device", default="cuda")
    p.add_argument("--parts", default="floor,b,a")
    p.add_argument("--concurrency", default="1,32,128")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--kv-cache-gib", type=float, default=8.0)
    p.add_argument("--rounds-at-c1", type=int, default=3)
    add_run_args(p, "b", ttft_lens="")
    p.add_argument("--copy-bytes", type=int, default=1 << 30)
    p.add_argument("--out", required=True)
    ns = p.parse_args(argv)
    ns.parts = set(ns.parts.split(","))
    ns.concurrency = int_list(ns.concurrency)
    ns.ttft_lens = int_list(ns.ttft_lens)
    return ns


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    device = torch.device(ns.device)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    result: dict[str, Any] = {
        "provenance": provenance("bench.suite_offline", argv),
        "shape": ns.shape,
        "device": str(device),
        "dtype": dtype,
    }
    if device.type == "cuda":
        result["device_name"] = torch.cuda.get_device_name(device)

    def save() -> None:
        Path(ns.out).write_text(json.dumps(result, indent=1))

    bandwidth = None
    if "floor" in ns.parts:
        try:
            bandwidth = result["copy_bandwidth"] = copy_bandwidth(device, ns.copy_bytes)
        except Exception as exc:  # noqa: BLE001 - recorded, the other parts still run
            result["copy_bandwidth"] = error_record(exc)
        save()
    if "b" in ns.parts:
        try:
            result["b"] = run_engine(ns, device, dtype, bandwidth)
        except Exception as exc:  # noqa: BLE001
            result["b"] = error_record(exc)
        free(device)
        save()
    if "a" in ns.parts:
        from engine.model.model_loader import load_model

        model, _ = load_model(ns.model, dtype, device, "dummy")  # the engine's weights
        try:
            result["a"] = run_hf_static(model, ns, device)
        except Exception as exc:  # noqa: BLE001
            result["a"] = error_record(exc)
        free(device)
        save()
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
