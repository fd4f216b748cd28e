"""Admission checks: every bad input fails here, before anything is scheduled."""

from __future__ import annotations

from collections.abc import Sequence

from engine.sampling_params import SamplingParams


def validate_prompt(
    prompt_token_ids: Sequence[int],
    sampling: SamplingParams,
    *,
    max_model_len: int,
    vocab_size: int,
    max_cache_tokens: int,
) -> None:
    """Raise ValueError naming the field and the limit when a request cannot run."""
    if len(prompt_token_ids) == 0:
        raise ValueError("prompt is empty: give at least one token")
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"prompt_token_ids: token id {bad[0]} is outside the vocabulary [0, {vocab_size})"
        )
    total = len(prompt_token_ids) + sampling.max_tokens
    if total > max_model_len:
        raise ValueError(
            f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({sampling.max_tokens}) = "
            f"{total} exceeds the model's context length {max_model_len}"
        )
    if total > max_cache_tokens:
        raise ValueError(
            f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({sampling.max_tokens}) = "
            f"{total} exceeds the KV cache capacity of {max_cache_tokens} tokens"
        )
