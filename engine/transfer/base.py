"""The transfer interface: one end of a pair's KV channel, whatever carries the bytes.

A worker sends KV to a peer through a `KVSender` and receives from a peer through a
`KVReceiver`. Neither names a pool: a prefill worker sends to a decode worker today,
and a decode worker may send a running request to another decode worker through the
same two ends. A worker holds each end as a `PairChannel`, made by
`engine.transfer.backends.make_channel` from the engine's `kv_transfer_backend`:
`engine.transfer.channel.KVChannel` (a 2-rank process group, NCCL between GPUs, gloo on
CPU) or `engine.transfer.fake.FakeChannel` (in process, for tests of hand-off, abort and
epoch logic without process groups).

Progress is a state, not an exception: a sent message's `TransferHandle.poll()` says
where it is (`KVPoll`), and `failure` says why it failed.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from typing import Any, Protocol

from engine.wire import ChannelSpec, HandoffHeader


class KVPoll(enum.Enum):
    """Where one message stands (SGLang's KVPoll states, minus the bootstrap server)."""

    WAITING = "waiting"  # posted, queued behind earlier messages on the pair
    TRANSFERRING = "transferring"  # header sent, payload on the wire
    SUCCESS = "success"  # the payload left this end; the receiver checks it
    FAILED = "failed"  # see TransferHandle.failure

    @property
    def is_done(self) -> bool:
        return self in (KVPoll.SUCCESS, KVPoll.FAILED)


class ChannelClosed(RuntimeError):
    """The peer left (a CLOSE header), or this end was closed."""


class TransferHandle(Protocol):
    """A message on its way."""

    def poll(self) -> KVPoll: ...

    @property
    def failure(self) -> str | None:
        """Why the transfer failed (None unless poll() is FAILED)."""
        ...

    def wait(self, timeout_s: float | None = None) -> KVPoll:
        """Block until done or timeout; returns the state."""
        ...

    def add_done_callback(self, fn: Callable[[KVPoll], None]) -> None:
        """Call fn(state) once the message is done (at once if it is already)."""
        ...


class KVSender(Protocol):
    """This worker's sending end toward one peer."""

    @property
    def peer_id(self) -> str: ...

    @property
    def closed(self) -> bool: ...

    def next_seq(self) -> int:
        """The sequence number of the next header posted on this end."""
        ...

    def send(self, header: HandoffHeader | None, payload: Any, ready: Any = None) -> TransferHandle:
        """Post header then payload (a tensor, or None); `ready` is a device event the
        payload's producer recorded: the send waits on it, not the producer. A None
        header posts the next part of the streamed message in progress."""
        ...

    def close(self, notify_peer: bool) -> None: ...


class KVReceiver(Protocol):
    """This worker's receiving end from one peer (used by one thread)."""

    @property
    def peer_id(self) -> str: ...

    @property
    def closed(self) -> bool: ...

    def recv_header(self, timeout_s: float | None = None) -> HandoffHeader:
        """Block until the next header (at most `timeout_s`, else an error); raises
        ChannelClosed when the peer left."""
        ...

    def recv_into(
        self, buffer: Any, then: Callable[[], None] | None = None, *, wait: bool = True
    ) -> None:
        """Receive the payload (or the next part of a streamed one) that follows a header
        into `buffer`; `then` (the scatter into the cache) runs right after it on the
        same stream. With `wait=False` a backend may return once both are posted (the
        next receive may reuse `buffer`: it is ordered after `then`); `settle()` waits."""
        ...

    def settle(self) -> None:
        """Block until every receive posted on this end is done."""
        ...

    def close(self, notify_peer: bool) -> None: ...


class PairChannel(KVSender, KVReceiver, Protocol):
    """One end of a pair's channel as a worker holds it, whatever carries the bytes: the
    spec both ends were made from, and `open()`, which blocks until the pair is joined
    (for a backend whose ends must meet first)."""

    @property
    def spec(self) -> ChannelSpec: ...

    def open(self) -> None: ...


class FutureHandle:
    """A TransferHandle over a concurrent Future whose job marks TRANSFERRING itself."""

    def __init__(self) -> None:
        self._state = KVPoll.WAITING
        self._failure: str | None = None
        self._done = threading.Event()
        self._callbacks: list[Callable[[KVPoll], None]] = []
        self._lock = threading.Lock()

    def poll(self) -> KVPoll:
        return self._state

    @property
    def failure(self) -> str | None:
        return self._failure

    def wait(self, timeout_s: float | None = None) -> KVPoll:
        self._done.wait(timeout_s)
        return self._state

    def add_done_callback(self, fn: Callable[[KVPoll], None]) -> None:
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn(self._state)

    def started(self) -> None:
        self._state = KVPoll.TRANSFERRING

    def finish(self, failure: str | None = None) -> None:
        """Mark it done (SUCCESS, or FAILED with the reason) and run the callbacks; the
        first call decides (a closing channel and its lane may both finish one)."""
        with self._lock:
            if self._done.is_set():
                return
            self._failure = failure
            self._state = KVPoll.FAILED if failure is not None else KVPoll.SUCCESS
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self._state)
