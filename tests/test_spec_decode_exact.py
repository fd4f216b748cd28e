"""Speculative decoding with each method, on CPU in float32: greedy and seeded outputs are
token for token those of the same engine without it, one request at a time and sixteen
at once, while proposals are really accepted (and, with a draft model unlike the target,
really rejected too)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.core.batch import Batch
from engine.factory import EngineArgs
from engine.llm import LLM
from engine.model.step_tokens import PendingTokens
from engine.sampling_params import SamplingParams
from engine.spec.spec_config import SpeculativeConfig
from tests.fakes import assert_engine_empty

NGRAM = SpeculativeConfig("ngram", 4, prompt_lookup_min=2, prompt_lookup_max=4)

# Copy-heavy: code with repeated identifiers, text to repeat or edit.
COPY_PROMPTS = [
    "def area(width, height):\n    return width * height\n\n"
    "def perimeter(width, height):\n    return 2 * (width + height)\n\n"
    "Rewrite both functions with type hints:\n",
    "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog near the "
    "river bank.\nRepeated:",
    "Fix the spelling: 'Teh weather tomorow will be sunny with a chance of rian in the "
    "evening.'\nFixed:",
    "for index in range(count):\n    total_sum = total_sum + values[index]\n"
    "for index in range(count):\n",
    "Names: Alice Smith, Bob Jones, Carol White. Write each name on its own line:\n",
    "1, 2, 3, 4, 5, 6,",
]


@pytest.fixture(scope="module")
def ngram_llm() -> Iterator[LLM]:
    yield LLM(EngineArgs(kv_cache_gib=0.25, speculative=NGRAM))


@pytest.fixture(scope="module")
def draft_llm(smollm2_path: Path) -> Iterator[LLM]:
    """The embedded model drafting for itself: every greedy proposal is accepted."""
    spec = SpeculativeConfig("draft_model", 3, model=str(smollm2_path))
    yield LLM(EngineArgs(kv_cache_gib=0.25, speculative=spec))


def _outputs(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> list[tuple[int, ...]]:
    out = [o.token_ids for o in llm.generate(prompts, params)]
    assert_engine_empty(llm.core)
    return out


def _mixed_params(num: int, max_tokens: int) -> list[SamplingParams]:
    """Half greedy, half seeded sampling."""
    return [
        SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0 if i % 2 else 0.8,
            top_p=0.95,
            seed=1000 + i,
            ignore_eos=True,
        )
        for i in range(num)
    ]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_one_at_a_time_equals_plain_decoding(
    method: str, request: pytest.FixtureRequest, reference_llm: LLM
) -> None:
    llm: LLM = request.getfixturevalue(f"{method.removesuffix('_model')}_llm")
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    before = llm.core.stats()
    for prompt in COPY_PROMPTS[:2]:
        assert _outputs(llm, [prompt], [params]) == _outputs(reference_llm, [prompt], [params])
    stats = llm.core.stats()
    accepted = stats.spec_accepted_tokens - before.spec_accepted_tokens
    verifications = stats.spec_verifications - before.spec_verifications
    assert accepted > verifications  # more than two tokens per verifying step, on average


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_sixteen_at_once_equal_plain_decoding(
    method: str, request: pytest.FixtureRequest, reference_llm: LLM
) -> None:
    llm: LLM = request.getfixturevalue(f"{method.removesuffix('_model')}_llm")
    prompts = [COPY_PROMPTS[i % len(COPY_PROMPTS)] for i in range(16)]
    params = _mixed_params(16, 8)
    before = llm.core.stats().spec_accepted_tokens
    assert _outputs(llm, prompts, params) == _outputs(reference_llm, prompts, params)
    assert llm.core.stats().spec_accepted_tokens > before


def test_stop_string_inside_an_accepted_run(ngram_llm: LLM, reference_llm: LLM) -> None:
    prompt = COPY_PROMPTS[1]
    params = SamplingParams(max_tokens=30, temperature=0.0, stop=("lazy",))
    spec = ngram_llm.generate([prompt], params)[0]
    plain = reference_llm.generate([prompt], params)[0]
    assert (spec.text, spec.token_ids, spec.finish_reason) == (
        plain.text,
        plain.token_ids,
        plain.finish_reason,
    )
    assert "lazy" not in spec.text  # nothing from the stop string on is returned
    assert_engine_empty(ngram_llm.core)


@pytest.fixture(scope="module")
def noisy_draft(tiny_model_paths: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny llama with noise on its weights: a draft that is right only some of the time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_paths["llama"], dtype=torch.float32)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.005)
    path = tmp_path_factory.mktemp("noisy-draft")
    model.save_pretrained(path)
    return str(path)


def test_a_draft_that_is_often_wrong_still_gives_plain_output(
    tiny_model_paths: dict[str, Path], noisy_draft: str
) -> None:
    target = str(tiny_model_paths["llama"])
    spec = SpeculativeConfig("draft_model", 4, model=noisy_draft)
    plain = LLM(EngineArgs(model=target, num_blocks=256, block_size=8))
    spec_llm = LLM(EngineArgs(model=target, num_blocks=256, block_size=8, speculative=spec))
    generator = torch.Generator().manual_seed(3)
    prompts = [
        torch.randint(10, 49000, (5 + 3 * i,), generator=generator).tolist() for i in range(16)
    ]
    params = _mixed_params(16, 16)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    assert [o.token_ids for o in spec_llm.generate(prompts, params)] == want
    stats = spec_llm.core.stats()
    assert (
        0.1 * stats.spec_draft_tokens < stats.spec_accepted_tokens < 0.9 * stats.spec_draft_tokens
    )
    assert_engine_empty(spec_llm.core)


def test_ngram_proposes_while_the_step_before_still_runs(reference_llm: LLM) -> None:
    """With async scheduling, n-gram proposals are made from the tokens before the one
    still being sampled (the step before runs meanwhile); outputs stay those of plain
    decoding, greedy and seeded, and such proposals are really verified and kept."""
    from engine.core.request import PLACEHOLDER_TOKEN

    llm = LLM(EngineArgs(kv_cache_gib=0.25, speculative=NGRAM, async_scheduling=True))
    assert llm.core.async_scheduling
    ahead = [0]
    launch = llm.runner.launch

    def spy(
        batch: Batch, *, use_cuda_graphs: bool = True, paged_decode: bool | None = None
    ) -> PendingTokens:
        ahead[0] += sum(
            1 for s in batch.seqs if s.num_draft_tokens and s.token_ids[0] == PLACEHOLDER_TOKEN
        )
        return launch(batch, use_cuda_graphs=use_cuda_graphs, paged_decode=paged_decode)

    llm.runner.launch = spy
    prompts = COPY_PROMPTS[:4]
    params = _mixed_params(4, 24)
    assert _outputs(llm, prompts, params) == _outputs(reference_llm, prompts, params)
    stats = llm.core.stats()
    assert ahead[0] > 0
    assert stats.spec_accepted_tokens > stats.spec_verifications
