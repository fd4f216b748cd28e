"""Frontend side of a request: token updates in, text chunks and stop-string finishes out."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.core.outputs import TextChunk
from engine.core.request import FinishReason
from engine.frontend.detokenizer import IncrementalDetokenizer


class OutputProcessor:
    """Detokenizes each request's tokens and applies stop strings."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._detoks: dict[str, IncrementalDetokenizer] = {}

    def add(self, req_id: str, prompt_token_ids: Sequence[int], stop: Sequence[str]) -> None:
        self._detoks[req_id] = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, stop)

    def remove(self, req_id: str) -> None:
        self._detoks.pop(req_id, None)

    def process(
        self, req_id: str, new_token_ids: Sequence[int], finish_reason: FinishReason | None
    ) -> tuple[TextChunk | None, FinishReason | None]:
        """Turn one engine update into client output: a chunk (None when nothing new is
        printable) and, at the end, the finish reason. A finish where the engine gave
        none is a stop string's: the caller aborts the engine side. Removes the request
        when it ends."""
        detok = self._detoks[req_id]
        text = detok.add(new_token_ids)
        stopped = detok.stopped
        if stopped:
            finish_reason = FinishReason.STOP
            new_token_ids = new_token_ids[: detok.num_read]  # none past the stop string
        elif finish_reason is not None:
            text += detok.flush()
        if finish_reason is not None:
            self.remove(req_id)
        chunk = TextChunk(text, tuple(new_token_ids)) if (text or new_token_ids) else None
        return chunk, finish_reason
