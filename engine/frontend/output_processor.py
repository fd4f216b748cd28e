"""Frontend side of one request: token updates in, text chunks and stop-string finishes out."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.core.outputs import TextChunk
from engine.core.request import FinishReason
from engine.frontend.detokenizer import IncrementalDetokenizer


class OutputProcessor:
    """Detokenizes one request's tokens and applies its stop strings.

    One per request, held by whoever streams it (the router across all its attempts),
    so it needs no key: the text state belongs to what the client has seen.
    """

    def __init__(
        self, tokenizer: Any, prompt_token_ids: Sequence[int], stop: Sequence[str]
    ) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, stop)

    def process(
        self, new_token_ids: Sequence[int], finish_reason: FinishReason | None
    ) -> tuple[TextChunk | None, FinishReason | None]:
        """Turn one engine update into client output: a chunk (None when nothing new is
        printable) and, at the end, the finish reason. A finish where the engine gave
        none is a stop string's: the caller aborts the engine side."""
        detok = self._detok
        text = detok.add(new_token_ids)
        if detok.stopped:
            finish_reason = FinishReason.STOP
            new_token_ids = new_token_ids[: detok.num_read]  # none past the stop string
        elif finish_reason is not None:
            text += detok.flush()
        chunk = TextChunk(text, tuple(new_token_ids)) if (text or new_token_ids) else None
        return chunk, finish_reason
