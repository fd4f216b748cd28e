"""Turn the three input forms (text, token ids, chat messages) into prompt token ids."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def encode_prompt(
    tokenizer: Any,
    *,
    prompt: str | None = None,
    prompt_token_ids: Sequence[int] | None = None,
    messages: Sequence[tuple[str, str]] | None = None,
) -> list[int]:
    """Exactly one input must be given; raises ValueError naming the problem."""
    given = [
        name
        for name, value in (
            ("prompt", prompt),
            ("prompt_token_ids", prompt_token_ids),
            ("messages", messages),
        )
        if value is not None
    ]
    if len(given) != 1:
        raise ValueError(
            "exactly one of prompt, prompt_token_ids or messages is required, got "
            + (", ".join(given) if given else "none")
        )
    if prompt_token_ids is not None:
        if len(prompt_token_ids) == 0:
            raise ValueError("prompt_token_ids is empty: give at least one token")
        return list(prompt_token_ids)
    if tokenizer is None:
        raise ValueError(
            f"{given[0]} needs a tokenizer; this model has none: send prompt_token_ids"
        )
    if prompt is not None:
        if not prompt:
            raise ValueError("prompt is empty: give at least one character")
        # verbose=False: a prompt longer than the model's context is refused later with the
        # request's own error; transformers' warning about it would only add noise to the log.
        return list(tokenizer.encode(prompt, add_special_tokens=True, verbose=False))
    assert messages is not None
    if not messages:
        raise ValueError("messages is empty: give at least one chat turn")
    for i, (role, _) in enumerate(messages):
        if role not in ("system", "user", "assistant", "tool"):
            raise ValueError(
                f"messages[{i}].role must be system, user, assistant or tool, got {role!r}"
            )
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("messages need a chat template; this model has none: send a prompt")
    ids = tokenizer.apply_chat_template(
        [{"role": r, "content": c} for r, c in messages],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
        tokenizer_kwargs={"verbose": False},
    )
    return list(ids)
