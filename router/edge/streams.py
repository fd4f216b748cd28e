"""How many tokens a stream message carries, and closing the core's stream.

Every message costs the router a protobuf, a gRPC write and a wake-up of the client,
whatever it carries. With many streams on a small model the router's event loop, not the
GPUs, sets the pace (one message per token per stream), so `--stream-interval N` has
each message after the first wait for N tokens, as vLLM's option of that name does. The
serving core applies it where the tokens arrive: a stream sleeps until its inbox holds
N tokens, a finish, a failure or a move (router/serving/inbox.py), so the detokenizer, the
stream's generators and the gRPC write run once per message. The first token goes at
once (time to first token is unchanged) and the finish flushes the rest, so only the
tokens in between wait, for at most N - 1 decode steps while the loop keeps up (under
many streams the poller lets new calls in between woken streams, router/serving/delivery.py, and
a message then carries what came meanwhile). `auto` (the default) chooses N from the
number of open streams: 1 under light load, more as the streams multiply.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Literal

logger = logging.getLogger(__name__)

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
