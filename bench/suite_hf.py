"""GPU suite, transformers parts (run by bench.suite_offline, in its process):

* a:  `generate()` with static batches (one batch per concurrency);
* a2: continuous batching, `model.generate_batch(...)` (paged attention).

Both take the engine's model (same random weights) and the burst prompts of b and c.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from bench.device import free, sync
from bench.suite_common import ReqTiming, make_prompts, summarize
from bench.suite_plan import RunSpec, prompts_for


def burst_prompts(shape: str, concurrency: int, prompt_len: int, vocab: int) -> list[list[int]]:
    """a, a2: one batch of `concurrency` prompts, the same as b's and c's burst."""
    return prompts_for(shape, RunSpec(concurrency, 1, prompt_len), vocab)


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
    vocab = model.config.vocab_size
    runs = []
    for c in ns.concurrency:
        prompts = burst_prompts(ns.shape, c, ns.prompt_len, vocab)
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


def _cb_round(manager: Any, prompts: list[list[int]], max_new_tokens: int) -> list[Any]:
    """Submit prompts to a running continuous-batching manager and wait for all of them."""
    ids = manager.add_requests(
        inputs=prompts, max_new_tokens=max_new_tokens, record_timestamps=True
    )
    wanted = set(ids)
    done: dict[Any, Any] = {}
    deadline = time.monotonic() + 600
    while len(done) < len(ids):
        res = manager.get_result(timeout=1)
        if res is None:
            if not manager.is_running():
                raise RuntimeError("the continuous batching thread stopped")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(ids) - len(done)} requests unfinished after 600 s")
            continue
        if res.request_id in wanted and res.is_finished():
            done[res.request_id] = res
    return [done[i] for i in ids]


def run_hf_continuous(model: Any, ns: argparse.Namespace, device: torch.device) -> dict:
    """One manager (sized for the largest concurrency, warmed once) serves every round,
    as a server would; set-up is reported, not timed into the rounds."""
    from transformers import GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    vocab = model.config.vocab_size
    # eos -1: no EOS (ignore_eos), every request makes exactly output_len tokens.
    gen = GenerationConfig(max_new_tokens=ns.output_len, do_sample=False, eos_token_id=-1)
    hints = WorkloadHints(
        max_prompt_length=ns.prompt_len,
        max_generated_length=ns.output_len,
        num_requests=max(ns.concurrency),
    )
    runs = []
    t0 = time.perf_counter()
    with model.continuous_batching_context_manager(
        generation_config=gen, block=True, timeout=10, workload_hints=hints
    ) as manager:
        setup_s = time.perf_counter() - t0
        _cb_round(manager, make_prompts(2, ns.prompt_len, vocab, seed=98), 4)  # warm-up
        for c in ns.concurrency:
            prompts = burst_prompts(ns.shape, c, ns.prompt_len, vocab)
            start = time.perf_counter()
            results = _cb_round(manager, prompts, ns.output_len)
            wall = time.perf_counter() - start
            timings = []
            for res in results:
                stamps = res.timestamps or []
                timings.append(
                    ReqTiming(
                        res.created_time,
                        first_s=stamps[0] if stamps else None,
                        last_s=stamps[-1] if stamps else None,
                        num_tokens=len(res.generated_tokens),
                        ok=res.error is None and len(res.generated_tokens) == ns.output_len,
                        error=str(res.error or ""),
                    )
                )
            runs.append(summarize("a2_hf_generate_batch", c, timings, wall))
    return {"setup_s": round(setup_s, 2), "runs": runs}
