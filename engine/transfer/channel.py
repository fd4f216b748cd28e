"""One KV channel per (prefill, decode) pair: a 2-rank process group of its own.

There is no global `init_process_group`. Both ends build the group directly from a
rendezvous store (the router's `TCPStore`) under a prefix that names both workers and
both epochs, so a restarted worker pairs afresh and nothing of the old pair is reused.
Payloads go over NCCL between GPUs and gloo on CPU; headers always over a gloo group of
their own, so the decode end waits for the next hand-off on the CPU and posts a receive
only for a payload that is on its way. The prefill end (rank 0) only sends and the decode
end (rank 1) only receives, so messages arrive in the order they were posted; every pair
has its own CUDA stream, so pairs move data concurrently.

Payloads leave from one sending thread per channel (the lane). A header leaves from the
thread that posts it when no earlier header waits on the lane: under load the lane
wakes late (it waits for the interpreter's lock while the engine thread launches the
next pass), and a streamed message's trailer, the last thing its receiver waits for,
would wait with it. Headers stay in posting order; a payload always follows its header
(its receive may wait on the decode GPU for the lane's send: a millisecond or so under
load, no longer than the lane's own wake-up, which it used to wait for before the
header left).

`KVChannel` is the process-group backend of `engine.transfer.base`'s `KVSender` (rank 0)
and `KVReceiver` (rank 1).
"""

from __future__ import annotations

import atexit
import datetime
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from engine.transfer.base import ChannelClosed, FutureHandle, KVPoll
from engine.transfer.handoff import decode_header, empty_header, encode_header
from engine.wire import ChannelSpec, HandoffHeader, HeaderKind

log = logging.getLogger(__name__)

# NCCL groups still being torn down on threads of their own. A process that exits while
# one is mid-abort takes the CUDA driver down under it and dies by SIGABRT, so exit waits
# for them, but only so long: an abort that hangs must not keep a stopped worker alive.
_ABORTS: set[threading.Thread] = set()
_ABORT_EXIT_WAIT_S = 10.0


@atexit.register
def _wait_for_aborts() -> None:
    deadline = time.monotonic() + _ABORT_EXIT_WAIT_S
    for thread in list(_ABORTS):
        thread.join(max(0.0, deadline - time.monotonic()))


SENDER_RANK = 0
RECEIVER_RANK = 1
# The spec's timeout bounds pairing and each transfer. Hand-offs may be any time apart, so
# the wait for the next header has no practical limit; a peer that dies closes its
# connection, which ends the wait at once.
_NEXT_HEADER_WAIT = datetime.timedelta(days=365)
# CUDA clamps a stream priority to the device's range: this is the highest on any GPU.
_HIGH_PRIORITY = -10


class KVChannel:
    """This worker's end of one pair's process group."""

    def __init__(self, spec: ChannelSpec, rank: int, device: torch.device) -> None:
        self.spec = spec
        self.rank = rank
        self.peer = RECEIVER_RANK if rank == SENDER_RANK else SENDER_RANK
        if device.type == "cuda" and device.index is None:
            # NCCL and set_device want an indexed device; a worker's runner may say "cuda".
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.is_cuda = device.type == "cuda"
        # ProcessGroupNCCL or ProcessGroupGloo: built directly, no global world.
        self._pg: Any = None
        self._ctrl: Any = None  # gloo group for headers
        self._lane = ThreadPoolExecutor(1, thread_name_prefix=f"kv-{spec.decode_id}")
        self._seq = 0
        self._closed = threading.Event()
        self._stream: torch.cuda.Stream | None = None
        # Sending: messages posted and not yet started on the lane (close() fails them:
        # a closed lane drops its queue), and streamed parts on their way, each with the
        # event that marks it sent (the payload is held until then). Receiving: buffers
        # with receives posted.
        self._jobs = threading.Lock()
        self._queued: set[FutureHandle] = set()
        self._unsettled: deque[tuple[torch.cuda.Event, torch.Tensor, FutureHandle]] = deque()
        self._posted: list[torch.Tensor] = []
        # Headers leave in posting order: one posted from the caller's thread must not
        # pass one still waiting on the lane.
        self._header_order = threading.Lock()
        self._headers_on_lane = 0

    @property
    def peer_id(self) -> str:
        return self.spec.receiver_id if self.rank == SENDER_RANK else self.spec.sender_id

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def open(self) -> None:
        """Build the process group; blocks until the other end does the same."""
        timeout = datetime.timedelta(seconds=self.spec.timeout_s)
        store = dist.TCPStore(
            self.spec.store_host, self.spec.store_port, is_master=False, timeout=timeout
        )
        prefixed = dist.PrefixStore(self.spec.prefix, store)
        # Headers always travel on a gloo group, host to host: the receiver waits for the
        # next one on the CPU, and posts the NCCL receive only for a payload that is
        # about to come. (A receive left pending on the GPU would hold a kernel that any
        # device-wide synchronisation in the engine then waits on.)
        self._ctrl = dist.ProcessGroupGloo(
            dist.PrefixStore("ctrl/", prefixed), self.rank, 2, timeout
        )
        if self.is_cuda:
            torch.cuda.set_device(self.device)
            # High priority, for this stream (the receiver's scatter into the cache) and
            # NCCL's own: a hand-off's kernels are small and on a request's path, and the
            # GPU then starts their blocks ahead of queued prefill and decode kernels.
            self._stream = torch.cuda.Stream(self.device, priority=_HIGH_PRIORITY)
            options = dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)
            options._timeout = timeout
            self._pg = dist.ProcessGroupNCCL(
                dist.PrefixStore("data/", prefixed), self.rank, 2, options
            )
            self._connect()
        else:
            # A group of its own for payloads on CPU too: a header posted while an earlier
            # payload waits on the lane must not land in that payload's receive.
            self._pg = dist.ProcessGroupGloo(
                dist.PrefixStore("data/", prefixed), self.rank, 2, timeout
            )

    def _connect(self) -> None:
        """Exchange one element over NCCL. NCCL makes the pair's communicator at its first
        transfer (a few hundred ms, the peers' handshake included); made here, that cost
        is paid when the channel opens, not by the first hand-off or the first move of
        a drain. Both ends run it inside `open`, before any header is posted."""
        assert self._stream is not None
        probe = torch.zeros(1, device=self.device)
        with torch.cuda.stream(self._stream):
            if self.rank == SENDER_RANK:
                self._pg.send([probe], self.peer, 0).wait()
            else:
                self._pg.recv([probe], self.peer, 0).wait()
        self._stream.synchronize()

    def _group(self) -> Any:
        if self._pg is None or self.closed:
            raise ChannelClosed(f"channel to {self.peer_id} is closed")
        return self._pg

    # ---------------------------------------------------------------- sending (prefill end)
    @property
    def num_posted(self) -> int:
        """Headers posted on this end so far."""
        return self._seq

    def next_seq(self) -> int:
        """The sequence number of the next header posted on this channel."""
        seq, self._seq = self._seq, self._seq + 1
        return seq

    def send(
        self,
        header: HandoffHeader | None,
        payload: torch.Tensor | None,
        ready: torch.cuda.Event | None = None,
    ) -> FutureHandle:
        """Post header then payload on this channel's lane (one thread: order is kept);
        a None header posts the next part of a streamed message.

        `ready` is recorded after the payload was gathered on the engine's stream; the
        send waits for it on this channel's stream instead of stalling the engine.
        """
        encoded = None if header is None else encode_header(header)
        handle = FutureHandle()
        header_sent = None  # the header's send, when it left from this thread
        if header is not None and encoded is not None:
            # CLOSE goes after every payload already queued: on the lane.
            header_sent = self._send_or_queue_header(encoded, header.kind is not HeaderKind.CLOSE)
            if header_sent is not None:
                encoded = None

        def run() -> None:
            with self._jobs:
                if handle not in self._queued:  # failed by close() meanwhile
                    return
                self._queued.discard(handle)
            try:
                pg = self._group()
                handle.started()
                if header_sent is not None:
                    header_sent.wait()
                if encoded is not None:
                    with self._header_order:
                        self._headers_on_lane -= 1
                        work = self._ctrl.send([encoded], self.peer, 0)
                    work.wait()
                if self._stream is None:
                    if payload is not None:
                        pg.send([payload], self.peer, 0).wait()
                else:
                    torch.cuda.set_device(self.device)
                    with torch.cuda.stream(self._stream):
                        if ready is not None:
                            self._stream.wait_event(ready)
                        if payload is not None:
                            pg.send([payload], self.peer, 0).wait()
                    if header is None and payload is not None:
                        # A streamed part: not waited for here, so the lane is free for
                        # the next part at once; the trailer's wait settles it.
                        sent = torch.cuda.Event()
                        sent.record(self._stream)
                        with self._jobs:
                            self._unsettled.append((sent, payload, handle))
                        self._reap_sent()
                        return
                    # The payload must outlive the transfer: hold it until it is sent.
                    self._stream.synchronize()
            except Exception as exc:  # noqa: BLE001 - reported as the handle's state
                failure = f"{type(exc).__name__}: {exc}"
                self._settle_sent(failure)
                handle.finish(failure)
                return
            self._settle_sent()
            handle.finish()

        with self._jobs:
            self._queued.add(handle)
        try:
            self._lane.submit(run)
        except RuntimeError as exc:  # the lane was shut down: the channel is closed
            with self._jobs:
                self._queued.discard(handle)
            handle.finish(f"channel to {self.peer_id} is closed ({exc})")
        return handle

    def _send_or_queue_header(self, encoded: torch.Tensor, now: bool) -> Any:
        """Post a header from this thread when `now` and no earlier header waits on the
        lane: its send, for the lane to wait for. Otherwise count it as waiting on the
        lane, in the same hold of the lock (no header posted meanwhile passes it): None."""
        with self._header_order:
            if now and not self._headers_on_lane and self._ctrl is not None and not self.closed:
                try:
                    return self._ctrl.send([encoded], self.peer, 0)
                except Exception:  # noqa: BLE001, S110 - the lane tries again and reports it
                    pass
            self._headers_on_lane += 1
            return None

    def _reap_sent(self) -> None:
        """Finish the streamed parts that have left (lane thread)."""
        with self._jobs:
            done = []
            while self._unsettled and self._unsettled[0][0].query():
                done.append(self._unsettled.popleft()[2])
        for handle in done:
            handle.finish()

    def _settle_sent(self, failure: str | None = None) -> None:
        """Every streamed part posted before is done: the stream was waited for, or the
        message failed with `failure`."""
        with self._jobs:
            handles = [handle for _, _, handle in self._unsettled]
            self._unsettled.clear()
        for handle in handles:
            handle.finish(failure)

    # ---------------------------------------------------------------- receiving (decode end)
    def recv_header(self, timeout_s: float | None = None) -> HandoffHeader:
        """Block until the next header arrives, or `timeout_s` passes (an error; None:
        no practical limit); call from the one receiving thread."""
        raw = empty_header()
        self._group()  # raises when closed
        wait = _NEXT_HEADER_WAIT if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        self._ctrl.recv([raw], self.peer, 0).wait(wait)
        header = decode_header(raw)
        if header.kind is HeaderKind.CLOSE:
            raise ChannelClosed(f"{self.peer_id} closed the channel")
        return header

    def recv_into(
        self, buffer: torch.Tensor, then: Callable[[], None] | None = None, *, wait: bool = True
    ) -> None:
        """Receive the payload that follows a header; `then` (e.g. the scatter into the
        cache) runs on this channel's stream right after it. `wait=False` only posts
        both (between GPUs): the next receive may reuse `buffer`, as the stream orders
        it after `then`, and `settle()` waits for everything posted."""
        pg = self._group()
        if self._stream is None:
            pg.recv([buffer], self.peer, 0).wait()
            if then is not None:
                then()
            return
        torch.cuda.set_device(self.device)
        with torch.cuda.stream(self._stream):
            pg.recv([buffer], self.peer, 0).wait()
            if then is not None:
                then()
        self._posted.append(buffer)  # held until its receive is done
        if wait:
            self.settle()

    def settle(self) -> None:
        """Block until every receive posted on this end, and what runs after it, is done."""
        # The last part usually landed before the trailer did: asking first spares this
        # thread a wait for the interpreter's lock, which a blocking wait gives up.
        if self._stream is not None and not self._stream.query():
            self._stream.synchronize()
        self._posted.clear()

    # ---------------------------------------------------------------- teardown
    def close(self, notify_peer: bool, timeout_s: float = 5.0) -> None:
        """Leave the pair. A live peer is told (CLOSE header) so its receiver stops; a dead
        one cannot be: NCCL's group is aborted so nothing waits on it for long."""
        if self.closed:
            return
        if notify_peer and self.rank == SENDER_RANK and self._pg is not None:
            handle = self.send(HandoffHeader(HeaderKind.CLOSE, self.next_seq()), None)
            if handle.wait(timeout_s) is not KVPoll.SUCCESS:
                log.info("channel to %s: close not delivered (%s)", self.peer_id, handle.failure)
        self._closed.set()
        if self._pg is not None and self.is_cuda:
            # Tearing NCCL's pair down can take a while (a drain spent half a second on
            # each end), and nothing waits on a closed channel: the peer was told, or is
            # gone. A worker that stops waits for it only at exit (`_wait_for_aborts`).
            thread = threading.Thread(
                target=self._abort, args=(self._pg,), name=f"kv-abort-{self.peer_id}", daemon=True
            )
            _ABORTS.add(thread)
            thread.start()
        self._lane.shutdown(wait=False, cancel_futures=True)
        # Whoever waits on a message that will never leave hears so now, not never (a
        # drain's move waits for its transfer).
        with self._jobs:
            never_sent, self._queued = list(self._queued), set()
        failure = f"channel to {self.peer_id} closed before it was sent"
        for handle in never_sent:
            handle.finish(failure)
        self._settle_sent(failure)

    def _abort(self, pg: Any) -> None:
        try:
            pg.abort()
        except Exception as exc:  # noqa: BLE001 - best effort on the way out
            log.info("channel to %s: abort: %s", self.peer_id, exc)
        finally:
            _ABORTS.discard(threading.current_thread())
