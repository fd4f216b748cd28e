"""Incremental detokenization with stop strings: never emits broken UTF-8 or a stop string.

The text of each new token comes from the tokenizers library's streaming decoder
(`tokenizers.decoders.DecodeStream`, primed with the end of the prompt): one step in
Rust per token, where re-decoding a window costs two `tokenizer.decode` calls (several
times the cost, and the router streams every request's tokens through here,
docs/benchmarks.md). Where that decoder would not give
`tokenizer.decode`'s text (a tokenizer without a fast backend, one that cleans up spaces
after decoding, a prompt that ends part-way through a character, an older library), a
short window of tokens is re-decoded with `tokenizer.decode` for each new token, as
vLLM's slow path does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# Tokens of context re-decoded with each new token: enough for a tokenizer's
# merges and byte-fallback sequences to settle (vLLM uses the same offset).
_CONTEXT_TOKENS = 5


class _WindowDecode:
    """New text per token by re-decoding a sliding window with `tokenizer.decode`;
    text that ends in an unfinished UTF-8 sequence waits for the tokens that finish it."""

    def __init__(self, tokenizer: Any, prompt_tail: list[int]) -> None:
        self._tokenizer = tokenizer
        self._tokens = list(prompt_tail)
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)

    def _decode(self, token_ids: list[int]) -> str:
        return str(self._tokenizer.decode(token_ids, skip_special_tokens=True))

    def push(self, token: int) -> str:
        self._tokens.append(token)
        prefix = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        full = self._decode(self._tokens[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._tokens)
            return full[len(prefix) :]
        return ""


class _StreamDecode:
    """New text per token from the tokenizers library's streaming decoder."""

    def __init__(self, backend: Any, stream: Any) -> None:
        self._backend = backend
        self._stream = stream

    def push(self, token: int) -> str:
        return self._stream.step(self._backend, token) or ""


class _NoText:
    """Models shipped without a tokenizer (dummy-weight benchmarks): token ids only."""

    def push(self, token: int) -> str:
        return ""


def _text_stream(tokenizer: Any, prompt_tail: list[int]) -> _WindowDecode | _StreamDecode | _NoText:
    """The cheapest way to get `tokenizer.decode`'s text of each token after this prompt."""
    if tokenizer is None:
        return _NoText()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (
        backend is None
        or getattr(tokenizer, "clean_up_tokenization_spaces", False)
        # A prompt that ends part-way through a character: the streaming decoder would
        # emit the prompt's own text with the first token.
        or tokenizer.decode(prompt_tail, skip_special_tokens=True).endswith("\ufffd")
    ):
        return _WindowDecode(tokenizer, prompt_tail)
    try:
        from tokenizers.decoders import DecodeStream

        # Primed with the prompt's end, so the first token's leading space (and any
        # merge across the boundary) decodes as it does after that prompt.
        stream = DecodeStream(prompt_tail, skip_special_tokens=True)
    except (ImportError, TypeError):  # no streaming decoder, or one that takes no prompt
        return _WindowDecode(tokenizer, prompt_tail)
    return _StreamDecode(backend, stream)


class IncrementalDetokenizer:
    """Turns a growing token stream into text deltas.

    Text is emitted only once it no longer ends in an unfinished UTF-8 sequence. With
    stop strings, the last `len(longest stop) - 1` characters are held back until it is
    clear they do not start a stop string; the stop string itself and anything after it
    are never emitted.
    """

    def __init__(
        self, tokenizer: Any, prompt_token_ids: Sequence[int], stop: Sequence[str] = ()
    ) -> None:
        self._text_stream = _text_stream(tokenizer, list(prompt_token_ids[-_CONTEXT_TOKENS:]))
        self._stop = tuple(stop)
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self.text = ""  # all decoded output text (truncated at a stop string)
        self._num_emitted = 0
        self.stopped = False  # a stop string was found
        # Of the tokens given to the last add(), how many it read: fewer than given when
        # a stop string ended the output part-way through them.
        self.num_read = 0

    def add(self, token_ids: Sequence[int]) -> str:
        """Feed new tokens; returns the text that became final."""
        self.num_read = 0
        if self.stopped:
            return ""
        push = self._text_stream.push
        for token in token_ids:
            self.num_read += 1
            self.text += push(token)
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
