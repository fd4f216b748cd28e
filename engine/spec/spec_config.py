"""Speculative decoding's configuration: `--speculative-config JSON`, spelled as vLLM spells it.

Two methods: `ngram` (prompt lookup: proposals copied from the request's own tokens, no
extra model) and `draft_model` (a small model with the target's vocabulary proposes).
Plain Python, no torch: the CLI checks a config before anything loads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

SpecMethod = Literal["ngram", "draft_model"]
METHODS: tuple[SpecMethod, ...] = ("ngram", "draft_model")

# A verify step runs 1 + k positions per speculating request; past 16 the rejected tail
# costs more target compute than the rare long acceptance gains.
MAX_SPECULATIVE_TOKENS = 16
# vLLM's n-gram default when neither bound is given.
DEFAULT_PROMPT_LOOKUP = 5

_KEYS = (
    "method",
    "model",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "disable_by_batch_size",
)


@dataclass(frozen=True)
class SpeculativeConfig:
    """How a decoding engine speculates: the method, proposals per step and its bounds."""

    method: SpecMethod
    num_speculative_tokens: int
    # ngram: the longest suffix of n tokens, n in [min, max], found earlier in the request
    # proposes the tokens that followed it.
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None  # draft_model: a local model folder with the target's vocabulary
    # No speculation in a step with more running requests than this (None: always): a
    # large batch is compute bound, where rejected proposals cost real throughput.
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"method {self.method!r} is not supported; pdserve speculates with "
                f"{' or '.join(repr(m) for m in METHODS)}"
            )
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1)
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be <= {MAX_SPECULATIVE_TOKENS}, "
                f"got {self.num_speculative_tokens}"
            )
        if self.disable_by_batch_size is not None:
            _check_int("disable_by_batch_size", self.disable_by_batch_size, 1)
        if self.method == "ngram":
            if self.model is not None:
                raise ValueError('"model" applies to method "draft_model", not "ngram"')
            low, high = self.prompt_lookup_min, self.prompt_lookup_max
            low = high if low is None else low
            high = low if high is None else high
            low = DEFAULT_PROMPT_LOOKUP if low is None else low
            high = DEFAULT_PROMPT_LOOKUP if high is None else high
            _check_int("prompt_lookup_min", low, 1)
            _check_int("prompt_lookup_max", high, 1)
            if low > high:
                raise ValueError(f"prompt_lookup_min ({low}) must be <= prompt_lookup_max ({high})")
            object.__setattr__(self, "prompt_lookup_min", low)
            object.__setattr__(self, "prompt_lookup_max", high)
        else:
            if not isinstance(self.model, str) or not self.model:
                raise ValueError('method "draft_model" needs "model": a local model folder')
            for key in ("prompt_lookup_min", "prompt_lookup_max"):
                if getattr(self, key) is not None:
                    raise ValueError(f'"{key}" applies to method "ngram", not "draft_model"')

    @classmethod
    def from_dict(cls, value: Any) -> SpeculativeConfig:
        """From a parsed JSON object; ValueError names the key at fault."""
        if not isinstance(value, dict):
            raise ValueError('expected a JSON object, e.g. {"method": "ngram", ...}')
        unknown = sorted(set(value) - set(_KEYS))
        if unknown:
            raise ValueError(f"unknown key {unknown[0]!r}; pdserve understands {', '.join(_KEYS)}")
        fields = dict(value)
        if "method" not in fields:
            # As vLLM reads it: a model named "ngram" means n-gram, any other a draft model.
            model = fields.get("model")
            if model in ("ngram", "[ngram]"):
                fields.pop("model")
                fields["method"] = "ngram"
            elif model is not None:
                fields["method"] = "draft_model"
            else:
                raise ValueError('give "method": "ngram" or "draft_model"')
        elif fields["method"] == "[ngram]":
            fields["method"] = "ngram"
        if "num_speculative_tokens" not in fields:
            raise ValueError('give "num_speculative_tokens": proposals per step, e.g. 4')
        return cls(**fields)

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """From the flag's JSON text; ValueError says what is wrong in one line."""
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not JSON: {exc}") from None
        return cls.from_dict(value)

    @property
    def uses_draft_model(self) -> bool:
        return self.method == "draft_model"

    def speculates_at(self, num_running: int) -> bool:
        """Whether a step with this many running requests speculates."""
        limit = self.disable_by_batch_size
        return limit is None or num_running <= limit


def _check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
