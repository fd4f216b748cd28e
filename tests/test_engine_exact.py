"""The whole engine (scheduler + block pool + packed runner) against transformers generate().

Eight or more prompts of varied length arrive staggered while others run; chunked prefill
on and off, prefix caching on and off (some prompts share a long prefix), and a block
budget so small that requests are preempted and recomputed. Greedy tokens must equal
transformers' float32 generate(). Where they differ at a genuine near-tie the standard
close-logprobs rule is accepted (both tokens in each other's top 2, logprob gap < 1e-3);
the test records which prompts needed it and fails if any mismatch is not such a tie.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.core.config import SchedulerConfig
from engine.factory import EngineArgs
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.wire import GenerationInput
from tests.fakes import assert_engine_empty

SHARED = (
    "The following is a conversation between a helpful assistant and a user who asks "
    "about history, science and cooking. The assistant answers in full sentences. "
)
TEXTS = [
    "Hello",
    "What is two plus two?",
    SHARED + "User: Why do leaves change colour in autumn?",
    "Write a short poem about winter mornings and hot tea.",
    SHARED + "User: How do I make bread?",
    "List the planets of the solar system in order from the Sun.",
    "def fibonacci(n):",
    SHARED + "User: Who built the pyramids?",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Q: What is the boiling point of water? A:",
]
MAX_TOKENS = [9, 12, 10, 14, 8, 11, 13, 7, 12, 6]
ARRIVAL_STEP = [0, 0, 1, 2, 3, 5, 6, 8, 9, 11]  # staggered: requests join running batches


@dataclass
class Reference:
    model: Any  # a transformers causal LM
    prompts: list[list[int]]
    tokens: list[list[int]]  # generate()'s greedy tokens (stops early at EOS)


def reference_for(path: Path) -> Reference:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
    prompts = [tok.encode(t) for t in TEXTS]
    tokens = []
    for p, n in zip(prompts, MAX_TOKENS, strict=True):
        out = model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)
        tokens.append(out[0, len(p) :].tolist())
    return Reference(model, prompts, tokens)


def run_engine(
    path: Path, scheduler: SchedulerConfig, num_blocks: int
) -> tuple[list[list[int]], int]:
    llm = LLM(EngineArgs(model=str(path), num_blocks=num_blocks, block_size=8, scheduler=scheduler))
    tok = llm.tokenizer
    assert tok is not None
    core = llm.core
    outputs: list[list[int]] = [[] for _ in TEXTS]
    step = 0
    pending = list(range(len(TEXTS)))
    reqs = []
    while pending or core.has_unfinished:
        while pending and ARRIVAL_STEP[pending[0]] <= step:
            i = pending.pop(0)
            sp = SamplingParams(max_tokens=MAX_TOKENS[i], temperature=0.0, ignore_eos=True)
            reqs.append(core.add_request(GenerationInput(str(i), tuple(tok.encode(TEXTS[i])), sp)))
        for upd in core.step():
            outputs[int(upd.req_id)].extend(upd.new_token_ids)
        step += 1
    assert_engine_empty(core)
    if scheduler.enable_prefix_caching and num_blocks > 100:
        assert core.scheduler.kv.stats.hit_tokens > 0, "shared prefix never hit the cache"
    return outputs, sum(r.num_preemptions for r in reqs)


def check(ref: Reference, outputs: list[list[int]]) -> list[int]:
    """Assert equality (or a genuine near-tie); returns the prompts that needed the rule."""
    near_ties = []
    for i, (want, got) in enumerate(zip(ref.tokens, outputs, strict=True)):
        assert len(got) == MAX_TOKENS[i]
        for k, w in enumerate(want):  # generate() stops at EOS; the engine ran on
            if got[k] == w:
                continue
            with torch.no_grad():
                ids = torch.tensor([ref.prompts[i] + got[:k]])
                logprobs = torch.log_softmax(ref.model(ids).logits[0, -1], dim=-1)
            top2 = set(torch.topk(logprobs, 2).indices.tolist())
            gap = abs(float(logprobs[w] - logprobs[got[k]]))
            assert {w, got[k]} <= top2 and gap < 1e-3, (
                f"prompt {i} token {k}: engine {got[k]} vs generate() {w}, gap {gap:.2e}"
            )
            near_ties.append(i)
            break  # past a tie the two trajectories legitimately diverge
    return near_ties


CONFIGS = {
    "chunked+prefix": (
        SchedulerConfig(long_prefill_token_threshold=8, max_num_batched_tokens=64),
        400,
    ),
    "whole+prefix": (SchedulerConfig(), 400),
    "chunked+noprefix": (
        SchedulerConfig(long_prefill_token_threshold=8, enable_prefix_caching=False),
        400,
    ),
    "whole+noprefix": (SchedulerConfig(enable_prefix_caching=False), 400),
    # 14 blocks of 8 tokens: the running set cannot all fit, so some are preempted.
    "preemption": (SchedulerConfig(max_num_batched_tokens=48, long_prefill_token_threshold=16), 14),
}


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_path: Path) -> Reference:
    return reference_for(smollm2_path)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_smollm2_engine_matches_generate(
    name: str, smollm2_path: Path, smollm2_reference: Reference
) -> None:
    scheduler, num_blocks = CONFIGS[name]
    outputs, preemptions = run_engine(smollm2_path, scheduler, num_blocks)
    near_ties = check(smollm2_reference, outputs)
    if name == "preemption":
        assert preemptions > 0
    # Recorded for the report (pytest -rA shows it); SmolLM2 needed none when written.
    print(f"{name}: near-tie fallback used for prompts {near_ties}")


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_tiny_architectures_engine_matches_generate(
    arch: str, tiny_model_paths: dict[str, Path]
) -> None:
    ref = reference_for(tiny_model_paths[arch])
    for name in ("chunked+prefix", "preemption"):
        scheduler, num_blocks = CONFIGS[name]
        outputs, _ = run_engine(tiny_model_paths[arch], scheduler, num_blocks)
        check(ref, outputs)
