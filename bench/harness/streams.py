"""One Generate call read to its end, whatever the end: every message, the final one, the
status. Tests assert on the result; benchmarks time it (`TimedStream`: when each batch
of tokens arrived)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from pdserve.v1 import generation_pb2 as pb
from router.cli.client import stream_generate


@dataclass
class StreamResult:
    """What a client saw on one Generate call."""

    tokens: list[int] = field(default_factory=list)
    text: str = ""
    final: pb.GenerateResponse | None = None
    code: grpc.StatusCode = grpc.StatusCode.OK  # the call's status
    details: str = ""  # the status details (the reason of an error status)
    num_finals: int = 0  # messages with a finish reason (exactly one on a sound stream)
    num_after_final: int = 0  # messages that came after the final one (none, ever)
    done_at: float = 0.0  # time.monotonic() when the call ended

    @property
    def finish_reason(self) -> str | None:
        """'FINISH_REASON_LENGTH', ... of the final message; None without one."""
        return None if self.final is None else pb.FinishReason.Name(self.final.finish_reason)

    @property
    def outcome(self) -> str:
        """'final:<FINISH_REASON_...>' when a final message came, else 'status:<CODE>'.

        An ERROR final is followed by an INTERNAL status: still one outcome, the final."""
        if self.final is not None:
            return f"final:{self.finish_reason}"
        return f"status:{self.code.name}"


async def generate(
    target: str | grpc.aio.Channel, *, on_tokens: Callable[[int], None] | None = None, **kwargs: Any
) -> StreamResult:
    """Run one Generate call (`router.cli.client.stream_generate` arguments) to its end.

    A failed call is a result too (its status in `code`); `on_tokens(n)` is called with
    the number of tokens received so far whenever more arrive.
    """
    result = StreamResult()
    try:
        async for resp in stream_generate(target, **kwargs):
            if result.final is not None:
                result.num_after_final += 1
            result.tokens.extend(resp.token_ids)
            result.text += resp.text
            if resp.token_ids and on_tokens is not None:
                on_tokens(len(result.tokens))
            if resp.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                result.num_finals += 1
                result.final = resp
    except grpc.aio.AioRpcError as exc:
        result.code = exc.code()
        result.details = exc.details() or ""
    result.done_at = time.monotonic()
    return result


@dataclass
class TimedStream:
    """One Generate call's result and when each batch of its tokens arrived."""

    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (monotonic, tokens so far)
    result: StreamResult | None = None  # None until the call ended

    @property
    def num_tokens(self) -> int:
        return self.arrivals[-1][1] if self.arrivals else 0

    @property
    def times(self) -> list[float]:
        """When each batch of tokens arrived (time.monotonic())."""
        return [t for t, _ in self.arrivals]

    def on_tokens(self, num_tokens: int) -> None:
        self.arrivals.append((time.monotonic(), num_tokens))

    async def run(self, target: str | grpc.aio.Channel, **kwargs: Any) -> StreamResult:
        """The call (`generate` keywords), timed; its result, also kept in `result`."""
        self.result = await generate(target, on_tokens=self.on_tokens, **kwargs)
        return self.result
