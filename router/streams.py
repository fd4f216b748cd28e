"""The core's output stream as the gRPC edge sends it: coalesced, and closed.

Fewer, larger stream messages: each carries at least `interval` tokens. Every message
costs the router a protobuf, a gRPC write and a wake-up of the client, whatever it
carries. With many streams on a small model the router's event loop, not the GPUs,
sets the pace (one message per token per stream), so `--stream-interval N` merges a
stream's chunks until N tokens are waiting, as vLLM's option of that name does. The
first chunk goes at once (time to first token is unchanged) and the final result
flushes whatever is left, so only the tokens in between wait, for at most N - 1 decode
steps.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from engine.core.outputs import FinalResult, TextChunk

logger = logging.getLogger("router.servicer")


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
