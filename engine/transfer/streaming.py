"""Layer-wise KV streaming, sending side: a prompt's KV leaves while its forward pass runs.

Before the forward pass that completes some prompts, the worker opens one streamed
message per receiver (the requests of `engine.transfer.sender.plan_messages`): a
`STREAM` header goes out at once, naming the entries. As the pass writes each group of
`layers_per_part` layers, `layer_written` gathers those layers of the entries' blocks
(one `index_select`, on the engine's stream, right behind the layer's attention) and
posts the part; the channel's own stream waits for the gather's event, so the bytes
move while later layers compute. When the step's tokens are known, `close` posts the
`TRAILER` with each entry's first token. Only the last part, and the trailer, are left
to travel after the pass.

Whatever happens to the step, every opened message is closed exactly once: parts the
pass did not announce are gathered and sent at close (correct, just not overlapped),
and `abort` closes them with `NO_TOKEN` for every entry, so the receiver drains the
parts, frees its reservations and stays in step.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from engine.transfer.base import FutureHandle, KVPoll, KVSender, TransferHandle
from engine.transfer.sender import Message
from engine.wire import NO_TOKEN, HandoffHeader, HeaderKind

# A part smaller than this is merged with the next layers: point-to-point messages of
# a few hundred KiB run far below the link, and each part has a fixed cost.
MIN_PART_BYTES = 2 << 20
# At most this many parts a message. Each part costs both workers' sending and receiving
# threads a few calls that give up the interpreter's lock, and under load each call may
# wait milliseconds to take it back from a busy engine thread (a burst's one-layer parts
# took the receiving thread several times as long to post as four larger ones), while
# the last part, the one left after the pass, is quick over NVLink even when large.
MAX_PARTS = 4

# gather(index, (first layer, stop layer)) -> (payload, ready event or None), where
# index = index_of(block_ids) was made once per message, before the pass.
Gather = Callable[[Any, tuple[int, int]], tuple[Any, Any]]


def layers_per_part(
    message_bytes: int, num_layers: int, min_part_bytes: int, max_parts: int = MAX_PARTS
) -> int:
    """Layers in each part so that a part carries at least `min_part_bytes` and the
    message has at most `max_parts` parts."""
    per_layer = max(1, message_bytes // num_layers)
    by_size = -(-min_part_bytes // per_layer)
    by_count = -(-num_layers // max(1, max_parts))
    return max(1, min(num_layers, max(by_size, by_count)))


class _AllOf(FutureHandle):
    """Done when every handle given is: FAILED with the first failure, else SUCCESS."""

    def __init__(self, handles: Sequence[TransferHandle]) -> None:
        super().__init__()
        self._left = len(handles)
        self._first_failure: str | None = None
        if not handles:
            self.finish()
        for handle in handles:
            handle.add_done_callback(functools.partial(self._one_done, handle=handle))

    def _one_done(self, state: KVPoll, *, handle: TransferHandle) -> None:
        with self._lock:
            if state is KVPoll.FAILED and self._first_failure is None:
                self._first_failure = handle.failure or "failed"
            self._left -= 1
            last = self._left == 0
        if last:
            self.finish(self._first_failure)


@dataclass
class StreamedMessage:
    """One receiver's streamed message of this step."""

    message: Message
    channel: KVSender
    header: HandoffHeader
    parts: list[tuple[int, int]]
    index: Any  # the blocks as the gather wants them (a device index, made once)
    next_part: int = 0
    handles: list[TransferHandle] = field(default_factory=list)

    @property
    def req_ids(self) -> list[str]:
        return [item.req_id for item in self.message.items]


class StepStream:
    """The streamed messages of one forward pass."""

    def __init__(self, messages: list[StreamedMessage], gather: Gather) -> None:
        self.messages = messages
        self._gather = gather
        self.closed = False

    def layer_written(self, layer_idx: int) -> None:
        """The pass has written layer `layer_idx` (layers come in order): post every
        part that is now complete."""
        for streamed in self.messages:
            while (
                streamed.next_part < len(streamed.parts)
                and streamed.parts[streamed.next_part][1] <= layer_idx + 1
            ):
                self._post_part(streamed)

    def _post_part(self, streamed: StreamedMessage) -> None:
        layers = streamed.parts[streamed.next_part]
        streamed.next_part += 1
        payload, ready = self._gather(streamed.index, layers)
        streamed.handles.append(streamed.channel.send(None, payload, ready))

    def close(self, first_tokens: Mapping[str, int]) -> dict[str, TransferHandle]:
        """End every message: parts not posted yet, then the trailer with each entry's
        first token (NO_TOKEN for an entry missing from `first_tokens`). Returns each
        request's handle: done once everything of its message has left."""
        if self.closed:
            raise RuntimeError("step stream closed twice")
        self.closed = True
        handles: dict[str, TransferHandle] = {}
        for streamed in self.messages:
            while streamed.next_part < len(streamed.parts):
                self._post_part(streamed)
            entries = tuple(
                replace(entry, first_token=first_tokens.get(entry.req_id, NO_TOKEN))
                for entry in streamed.message.entries
            )
            trailer = HandoffHeader(
                HeaderKind.TRAILER,
                streamed.header.seq_no,
                streamed.header.dst_epoch,
                streamed.header.src_epoch,
                entries,
                posted_at_us=int(time.time() * 1e6),
            )
            streamed.handles.append(streamed.channel.send(trailer, None))
            done = _AllOf(streamed.handles)
            for req_id in streamed.req_ids:
                handles[req_id] = done
        return handles

    def abort(self) -> None:
        """The pass failed: close every message with no continuation for any entry."""
        if not self.closed:
            self.close({})


def open_stream(
    messages: Sequence[tuple[Message, KVSender]],
    *,
    src_epoch: int,
    num_layers: int,
    block_bytes: int,
    gather: Gather,
    index_of: Callable[[list[int]], Any] = lambda block_ids: block_ids,
    min_part_bytes: int = MIN_PART_BYTES,
    max_parts: int = MAX_PARTS,
) -> StepStream:
    """Post one STREAM header per message (on the thread that posts every message of
    these channels, so sequence numbers follow posting order) and return the step's
    stream."""
    streamed: list[StreamedMessage] = []
    for message, channel in messages:
        num_bytes = len(message.block_ids) * block_bytes
        per_part = layers_per_part(num_bytes, num_layers, min_part_bytes, max_parts)
        header = HandoffHeader(
            kind=HeaderKind.STREAM,
            seq_no=channel.next_seq(),
            dst_epoch=message.target.epoch,
            src_epoch=src_epoch,
            entries=message.entries,
            num_bytes=num_bytes,
            posted_at_us=int(time.time() * 1e6),
            layers_per_part=per_part,
        )
        parts = header.parts(num_layers)
        item = StreamedMessage(message, channel, header, parts, index_of(message.block_ids))
        item.handles.append(channel.send(header, None))
        streamed.append(item)
    return StepStream(streamed, gather)
