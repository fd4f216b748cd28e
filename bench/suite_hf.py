"""GPU suite, part a (run by bench.suite_offline, in its process): transformers
`generate()` with static batches (one batch per concurrency), on the engine's model (same
random weights) and the burst prompts of b and c.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from bench.device import free, sync
from bench.suite_common import ReqTiming, summarize
from bench.suite_plan import RunSpec, prompts_for


def burst_prompts(shape: str, concurrency: int, prompt_len: int, vocab: int) -> list[list[int]]:
    """a: one batch of `concurrency` prompts, the same as b's and c's burst."""
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
