"""The core's output stream as the gRPC edge sends it: coalesced, and closed.

Fewer, larger stream messages: each carries at least `interval` tokens. Every message
costs the router a protobuf, a gRPC write and a wake-up of the client, whatever it
carries. With many streams on a small model the router's event loop, not the GPUs,
sets the pace (one message per token per stream), so `--stream-interval N` merges a
stream's chunks until N tokens are waiting, as vLLM's option of that name does. The
first chunk goes at once (time to first token is unchanged) and the final result
flushes whatever is left, so only the tokens in between wait, for at most N - 1 decode
steps. `auto` (the default) chooses N from the number of open streams: 1 under light
load, more as the streams multiply; the serving core then wakes a stream only when its
N tokens are in (router/inbox.py), so the edge has nothing left to merge.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Literal

from engine.core.outputs import FinalResult, TextChunk

logger = logging.getLogger("router.servicer")

# `--stream-interval auto`: one token a message while fewer than AUTO_FROM_STREAMS streams
# are open (the per-message cost is then small), then one more token a message for every
# AUTO_STREAMS_PER_TOKEN streams, up to AUTO_MAX_TOKENS: at 128 streams 8 tokens a message,
# where the router's event loop, not the GPUs, would otherwise set the pace.
AUTO_FROM_STREAMS = 32
AUTO_STREAMS_PER_TOKEN = 16
AUTO_MAX_TOKENS = 16

StreamInterval = int | Literal["auto"]


def tokens_per_message(interval: StreamInterval, num_streams: int) -> int:
    """Tokens a stream message waits for after the first, with `num_streams` streams open."""
    if interval != "auto":
        return interval
    if num_streams < AUTO_FROM_STREAMS:
        return 1
    return min(AUTO_MAX_TOKENS, num_streams // AUTO_STREAMS_PER_TOKEN)


def check_stream_interval(interval: object) -> StreamInterval:
    """`interval` if it is "auto" or an integer >= 1; ValueError otherwise."""
    if interval == "auto" or (isinstance(interval, int) and interval >= 1):
        return interval  # type: ignore[return-value]
    raise ValueError(f"stream interval must be 'auto' or an integer >= 1, got {interval!r}")


class CoalescedStream:
    """`stream`'s items with its TextChunks merged to >= `interval` tokens each (the first
    chunk and the one before the final result excepted). Closing is the caller's: it
    closes `stream` itself."""

    def __init__(self, stream: AsyncIterator[TextChunk | FinalResult], interval: int) -> None:
        if interval < 1:
            raise ValueError(f"stream interval must be >= 1, got {interval}")
        self._stream = stream
        self._interval = interval
        self._sent_first = False
        self._final: FinalResult | None = None  # read while flushing; returned next
        self._ended = False

    def __aiter__(self) -> CoalescedStream:
        return self

    async def __anext__(self) -> TextChunk | FinalResult:
        if self._final is not None:
            final, self._final = self._final, None
            return final
        if self._ended:
            raise StopAsyncIteration
        texts: list[str] = []
        token_ids: list[int] = []
        while True:
            try:
                out = await anext(self._stream)
            except StopAsyncIteration:
                self._ended = True
                if texts or token_ids:
                    return _merged(texts, token_ids)
                raise
            if isinstance(out, FinalResult):
                if not (texts or token_ids):
                    return out
                self._final = out
                return _merged(texts, token_ids)
            texts.append(out.text)
            token_ids.extend(out.token_ids)
            if not self._sent_first and (out.text or out.token_ids):
                self._sent_first = True
                return _merged(texts, token_ids)
            if len(token_ids) >= self._interval:
                return _merged(texts, token_ids)


def _merged(texts: list[str], token_ids: list[int]) -> TextChunk:
    return TextChunk("".join(texts), tuple(token_ids))


async def close_stream(stream: AsyncIterator[object], request_id: str) -> None:
    """Close the core's stream: that runs its `finally`, which aborts the request and
    frees its blocks. A failure is logged, never raised (the client's status is decided)."""
    aclose = getattr(stream, "aclose", None)
    if aclose is None:
        return
    try:
        await aclose()
    except Exception:
        logger.exception("request %s: closing the core stream failed", request_id)
