"""Speculative decoding on the embedded model (CPU, float32): greedy and seeded outputs are
token for token those of the same engine without it, one request at a time and sixteen
at once, while proposals are really accepted (the step count drops)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from engine.core.spec_config import SpeculativeConfig
from engine.factory import EngineArgs
from engine.llm import LLM
from engine.sampling_params import SamplingParams
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
def spec_llm() -> Iterator[LLM]:
    yield LLM(EngineArgs(kv_cache_gib=0.25, speculative=NGRAM))


def _tokens(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> list[tuple[int, ...]]:
    return [out.token_ids for out in llm.generate(prompts, params)]


def test_greedy_one_at_a_time_equals_plain_decoding(spec_llm: LLM, reference_llm: LLM) -> None:
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    before = spec_llm.core.stats()
    for prompt in COPY_PROMPTS[:3]:
        assert _tokens(spec_llm, [prompt], [params]) == _tokens(reference_llm, [prompt], [params])
    stats = spec_llm.core.stats()
    accepted = stats.spec_accepted_tokens - before.spec_accepted_tokens
    verifications = stats.spec_verifications - before.spec_verifications
    assert accepted > verifications  # more than one token per verifying step, on average
    assert_engine_empty(spec_llm.core)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_sixteen_at_once_equal_plain_decoding(
    spec_llm: LLM, reference_llm: LLM, temperature: float
) -> None:
    prompts = [COPY_PROMPTS[i % len(COPY_PROMPTS)] for i in range(16)]
    params = [
        SamplingParams(
            max_tokens=8 + i % 5,
            temperature=temperature,
            top_p=0.95 if temperature else 1.0,
            seed=1000 + i,
            ignore_eos=True,
        )
        for i in range(16)
    ]
    before = spec_llm.core.stats().spec_accepted_tokens
    assert _tokens(spec_llm, prompts, params) == _tokens(reference_llm, prompts, params)
    assert spec_llm.core.stats().spec_accepted_tokens > before
    assert_engine_empty(spec_llm.core)


def test_stop_string_inside_an_accepted_run(spec_llm: LLM, reference_llm: LLM) -> None:
    prompt = COPY_PROMPTS[1]
    params = SamplingParams(max_tokens=40, temperature=0.0, stop=("lazy",))
    spec = spec_llm.generate([prompt], params)[0]
    plain = reference_llm.generate([prompt], params)[0]
    assert (spec.text, spec.token_ids, spec.finish_reason) == (
        plain.text,
        plain.token_ids,
        plain.finish_reason,
    )
    assert "lazy" not in spec.text  # nothing from the stop string on is returned
    assert_engine_empty(spec_llm.core)
