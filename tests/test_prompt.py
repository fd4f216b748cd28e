"""Encoding prompts: an over-long one is left to the request's own refusal, with nothing
from the tokenizer in the log."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.frontend.prompt import encode_prompt
from engine.model.model_loader import load_tokenizer


@pytest.mark.parametrize("form", ["prompt", "messages"])
def test_an_over_long_prompt_is_encoded_without_the_tokenizers_warning(
    form: str, smollm2_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    tokenizer = load_tokenizer(smollm2_path)  # transformers warns once per tokenizer
    text = "hello " * 9001
    capfd.readouterr()
    if form == "prompt":
        ids = encode_prompt(tokenizer, prompt=text)
    else:
        ids = encode_prompt(tokenizer, messages=[("user", text)])
    assert len(ids) > tokenizer.model_max_length  # longer than the model's context
    captured = capfd.readouterr()
    assert "sequence length is longer" not in captured.err + captured.out
