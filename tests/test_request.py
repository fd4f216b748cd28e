"""A request keeps one token list; its prompt and outputs are views that follow it."""

from __future__ import annotations

import pytest

from engine.core.request import PLACEHOLDER_TOKEN, Request
from engine.sampling_params import SamplingParams


def make(prompt: list[int], max_tokens: int = 8) -> Request:
    return Request(
        "r",
        list(prompt),
        len(prompt),
        SamplingParams(max_tokens=max_tokens, temperature=0.0),
        seed=0,
    )


def test_outputs_grow_and_change_in_the_one_list_the_views_read() -> None:
    req = make([5, 6, 7])
    prompt, outputs = req.prompt_token_ids, req.output_token_ids
    req.append_output_token(PLACEHOLDER_TOKEN)
    req.set_output_token(3, 42)
    req.append_output_token(PLACEHOLDER_TOKEN)
    assert list(prompt) == [5, 6, 7] and prompt == [5, 6, 7]
    assert outputs == [42, PLACEHOLDER_TOKEN] and outputs[-1] == PLACEHOLDER_TOKEN
    assert req.all_token_ids == [5, 6, 7, 42, PLACEHOLDER_TOKEN]
    req.drop_placeholders()
    assert outputs == [42] and outputs[:] == [42] and req.num_tokens == 4
    assert (req.num_output_tokens, req.last_output_token) == (1, 42)
    with pytest.raises(IndexError):
        outputs[1]


def test_stop_rules_read_outputs_through_the_one_list() -> None:
    req = make([1, 2], max_tokens=2)
    req.append_output_token(9)
    assert req.check_stop(1) is None
    req.append_output_token(9)
    assert req.check_stop(2) is not None  # max_tokens reached


def test_a_prompt_longer_than_the_token_list_is_refused() -> None:
    with pytest.raises(ValueError, match="prompt tokens"):
        Request("r", [1], 2, SamplingParams(max_tokens=1), seed=0)
