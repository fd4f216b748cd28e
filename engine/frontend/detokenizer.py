"""Incremental detokenization with stop strings: never emits broken UTF-8 or a stop string."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# Tokens of context re-decoded with each new token: enough for a tokenizer's
# merges and byte-fallback sequences to settle (vLLM uses the same offset).
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a growing token stream into text deltas.

    Text is decoded over a short sliding window and emitted only once it no
    longer ends in a replacement character (an unfinished UTF-8 sequence).
    With stop strings, the last `len(longest stop) - 1` characters are held
    back until it is clear they do not start a stop string; the stop string
    itself and anything after it are never emitted.
    """

    def __init__(
        self, tokenizer: Any, prompt_token_ids: Sequence[int], stop: Sequence[str] = ()
    ) -> None:
        self._tokenizer = tokenizer
        self._tokens = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)
        self._stop = tuple(stop)
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self.text = ""  # all decoded output text (truncated at a stop string)
        self._num_emitted = 0
        self.stopped = False  # a stop string was found
        # Of the tokens given to the last add(), how many it read: fewer than given when
        # a stop string ended the output part-way through them.
        self.num_read = 0

    def _decode(self, token_ids: list[int]) -> str:
        if self._tokenizer is None:  # dummy-weight models may ship no tokenizer: ids only
            return ""
        return self._tokenizer.decode(token_ids, skip_special_tokens=True)

    def add(self, token_ids: Sequence[int]) -> str:
        """Feed new tokens; returns the text that became final."""
        self.num_read = 0
        if self.stopped:
            return ""
        for token in token_ids:
            self.num_read += 1
            self._tokens.append(token)
            prefix = self._decode(self._tokens[self._prefix_offset : self._read_offset])
            full = self._decode(self._tokens[self._prefix_offset :])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                self.text += full[len(prefix) :]
                self._prefix_offset = self._read_offset
                self._read_offset = len(self._tokens)
            if self._stop and self._check_stop():
                break
        limit = len(self.text) if self.stopped else len(self.text) - self._holdback
        return self._emit_until(limit)

    def _check_stop(self) -> bool:
        # Only the tail can contain a stop string that was not there before.
        start = max(0, self._num_emitted - self._holdback)
        hits = [i for s in self._stop if (i := self.text.find(s, start)) >= 0]
        if not hits:
            return False
        self.text = self.text[: min(hits)]
        self.stopped = True
        return True

    def flush(self) -> str:
        """The held-back text, once the request has finished for another reason."""
        return self._emit_until(len(self.text))

    def _emit_until(self, limit: int) -> str:
        if limit <= self._num_emitted:
            return ""
        delta = self.text[self._num_emitted : limit]
        self._num_emitted = limit
        return delta
