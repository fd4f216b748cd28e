"""An in-process transfer backend: both ends of a pair in one process, joined by a queue.

Workers use it with `kv_transfer_backend="fake"` (engine.transfer.backends): the two
ends made from one `ChannelSpec` in this process join each other. Tests may also make a
pair directly (`FakeChannel.pair`). It keeps the channel's contract (order, CLOSE, a
broken peer fails the pending receive) so hand-off, abort, epoch and routing logic can
be tested in milliseconds, with no process group. Tests steer it: `hold()` keeps posted
messages WAITING until `release()`, `fail_next(reason)` fails the next send, `break_()`
fails every pending and later operation as a dead peer would, and `defer_posted()`
makes a receive posted without waiting land only at `settle()`, as on a device.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

from engine.transfer.base import ChannelClosed, FutureHandle
from engine.wire import ChannelSpec, HandoffHeader, HeaderKind

_BROKEN = object()
# Pairs with one end made and the other not yet: spec prefix → (link, made by sender).
_HALF_MADE: dict[str, tuple[_Link, bool]] = {}
_HALF_MADE_LOCK = threading.Lock()


class _Link:
    """What both ends share."""

    def __init__(self) -> None:
        self.messages: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.held: list[tuple[HandoffHeader | None, Any, FutureHandle]] = []
        self.holding = False
        self.fail_next: str | None = None
        self.broken = False
        self.lock = threading.Lock()
        self.num_sent = 0


class FakeChannel:
    """One end (sender or receiver) of an in-process pair."""

    def __init__(self, link: _Link, spec: ChannelSpec, sending: bool) -> None:
        self.spec = spec
        self._link = link
        self._peer_id = spec.receiver_id if sending else spec.sender_id
        self._sending = sending
        self._seq = 0
        self._closed = threading.Event()
        self._defer_posted = False
        self._posted: list[tuple[Any, Any, Callable[[], None] | None]] = []

    @classmethod
    def pair(cls, sender_id: str, receiver_id: str) -> tuple[FakeChannel, FakeChannel]:
        """(the sender's end, the receiver's end)."""
        link = _Link()
        spec = ChannelSpec("in-process", 0, sender_id, 0, receiver_id, 0)
        return cls(link, spec, True), cls(link, spec, False)

    @classmethod
    def for_spec(cls, spec: ChannelSpec, sending: bool) -> FakeChannel:
        """This process's end of the pair `spec` names: joined to the other end when that
        one is made (before or after this one; messages wait in the pair's queue)."""
        with _HALF_MADE_LOCK:
            half = _HALF_MADE.pop(spec.prefix, None)
            if half is None or half[1] == sending:  # the first end (or that end again)
                link = _Link()
                _HALF_MADE[spec.prefix] = (link, sending)
            else:
                link = half[0]
        return cls(link, spec, sending)

    def open(self) -> None:
        """Nothing to wait for: the pair's queue holds what is sent before the peer reads."""

    @property
    def peer_id(self) -> str:
        return self._peer_id

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    @property
    def num_sent(self) -> int:
        """Messages that left this pair's sender (hand-offs and CLOSE)."""
        return self._link.num_sent

    # ---------------------------------------------------------------- test controls
    def hold(self) -> None:
        """Keep messages posted from now on WAITING until release()."""
        self._link.holding = True

    def release(self) -> None:
        with self._link.lock:
            self._link.holding = False
            held, self._link.held = self._link.held, []
        for header, payload, handle in held:
            self._deliver(header, payload, handle)

    def fail_next(self, reason: str) -> None:
        """The next send fails before anything reaches the receiver."""
        self._link.fail_next = reason

    def defer_posted(self) -> None:
        """Receives posted with `wait=False` from now on land (bytes, then their `then`)
        only at settle(), in order: a device channel's stream runs them after the call."""
        self._defer_posted = True

    def break_(self) -> None:
        """The peer died: pending and later operations on both ends fail."""
        self._link.broken = True
        self._link.messages.put(_BROKEN)

    # ---------------------------------------------------------------- sending
    def next_seq(self) -> int:
        seq, self._seq = self._seq, self._seq + 1
        return seq

    def send(self, header: HandoffHeader | None, payload: Any, ready: Any = None) -> FutureHandle:
        handle = FutureHandle()
        if self.closed or self._link.broken:
            handle.finish("channel is closed")
            return handle
        if self._link.fail_next is not None:
            reason, self._link.fail_next = self._link.fail_next, None
            handle.finish(reason)
            return handle
        # A copy: the sender may reuse its buffer once the send is done, as with NCCL.
        data = None if payload is None else payload.clone()
        with self._link.lock:
            if self._link.holding:
                self._link.held.append((header, data, handle))
                return handle
        self._deliver(header, data, handle)
        return handle

    def _deliver(self, header: HandoffHeader | None, payload: Any, handle: FutureHandle) -> None:
        # Header and payload travel as two items, as on the channel's two groups; a
        # streamed message's parts are payload items of their own.
        handle.started()
        if header is not None:
            self._link.messages.put((header, None))
            self._link.num_sent += 1
        if payload is not None:
            self._link.messages.put((None, payload))
        handle.finish()

    # ---------------------------------------------------------------- receiving
    def recv_header(self, timeout_s: float | None = None) -> HandoffHeader:
        if self.closed:
            raise ChannelClosed(f"channel from {self._peer_id} is closed")
        try:
            item = self._link.messages.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"no header from {self._peer_id} in {timeout_s:g} s") from None
        if item is _BROKEN or self._link.broken:
            raise ConnectionResetError(f"{self._peer_id} is gone")
        header, _ = item
        if header is None:
            raise ValueError("a payload where a header was expected: out of step")
        if header.kind is HeaderKind.CLOSE:
            raise ChannelClosed(f"{self._peer_id} closed the channel")
        return header

    def recv_into(
        self, buffer: Any, then: Callable[[], None] | None = None, *, wait: bool = True
    ) -> None:
        item = None if self._link.broken else self._link.messages.get()
        if item is None or item is _BROKEN or self._link.broken:
            raise ConnectionResetError(f"{self._peer_id} is gone")
        header, payload = item
        if header is not None:
            raise ValueError("a header where a payload was expected: out of step")
        self._posted.append((buffer, payload, then))
        if wait or not self._defer_posted:
            self.settle()

    def settle(self) -> None:
        posted, self._posted = self._posted, []
        for buffer, payload, then in posted:
            buffer.copy_(payload.reshape(buffer.shape))
            if then is not None:
                then()

    # ---------------------------------------------------------------- teardown
    def close(self, notify_peer: bool) -> None:
        if self.closed:
            return
        if notify_peer and self._sending and not self._link.broken:
            self.send(HandoffHeader(HeaderKind.CLOSE, self.next_seq()), None)
        self._closed.set()
        if not self._sending:
            self._link.messages.put(_BROKEN if self._link.broken else _closed_marker())


def _closed_marker() -> tuple[HandoffHeader, None]:
    return HandoffHeader(HeaderKind.CLOSE, -1), None
