"""Rank 0 of a tensor-parallel worker hands each model call to the other ranks.

Rank 0 runs the scheduler; every rank must run the same model calls in the same order,
or their collectives would pair up different steps. Rank 0 publishes each call (its
method name and arguments: the frozen `Batch` of a step, a KV import's block ids) to
every other rank over a Unix socket of the node (abstract namespace: no file, nothing
reachable off the node) before running it itself; the others replay it on their own
runner. A pickled decode step is a few kilobytes, sent in tens of microseconds: no Ray
call and no device round trip per step.

A rank whose peer's socket closes knows that the worker is gone: the group lives and
dies as a whole (engine.worker.actor's `TPLeader` and engine.parallel.tp_follower).
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

log = logging.getLogger(__name__)

Call = tuple[str, tuple[Any, ...], dict[str, Any]]


class StepPublisher:
    """Rank 0's end: accepts the other ranks, then sends them every call."""

    def __init__(self, address: str, authkey: bytes, num_followers: int) -> None:
        self._listener = Listener(address, family="AF_UNIX", authkey=authkey)
        self._num_followers = num_followers
        self._conns: list[Connection] = []
        self._lock = threading.Lock()  # calls leave whole, in one order, from any thread

    def accept_all(self) -> None:
        """Wait until every other rank has connected (they connect once their model is
        built, as this rank's is)."""
        while len(self._conns) < self._num_followers:
            self._conns.append(self._listener.accept())
        self._listener.close()

    def publish(self, method: str, *args: Any, **kwargs: Any) -> None:
        """Send one call to every other rank (before running it here)."""
        data = pickle.dumps((method, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            for conn in self._conns:
                conn.send_bytes(data)

    @property
    def num_followers(self) -> int:
        return self._num_followers

    def watch(
        self,
        on_lost: Callable[[int], None],
        on_message: Callable[[int, tuple[Any, ...]], None] | None = None,
    ) -> None:
        """Call `on_message(rank, message)` for each message a rank sends back, and
        `on_lost(rank)` when its socket closes (the rank died, and with it the worker);
        both from a thread of the rank's own."""
        for rank, conn in enumerate(self._conns, start=1):
            threading.Thread(
                target=_listen,
                args=(conn, rank, on_lost, on_message),
                daemon=True,
                name=f"tp-watch-{rank}",
            ).start()

    def close(self) -> None:
        with self._lock:
            for conn in self._conns:
                conn.close()
            self._conns.clear()


def _listen(
    conn: Connection,
    rank: int,
    on_lost: Callable[[int], None],
    on_message: Callable[[int, tuple[Any, ...]], None] | None,
) -> None:
    try:
        while True:
            message = pickle.loads(conn.recv_bytes())
            if on_message is not None:
                on_message(rank, message)
    except (EOFError, OSError):
        on_lost(rank)


def connect(address: str, authkey: bytes, timeout_s: float = 300.0) -> Connection:
    """A follower's end, once rank 0 listens (it may still be loading its model)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return Client(address, family="AF_UNIX", authkey=authkey)
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"rank 0 of the group did not listen within {timeout_s:.0f}s"
                ) from None
            time.sleep(0.05)


def replay(conn: Connection, target: object) -> None:
    """Run every call rank 0 publishes on `target`, in order, until rank 0 goes away. A
    call that raises (a batch rank 0 refuses too) is logged and the next one runs."""
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return
        method, args, kwargs = pickle.loads(data)
        try:
            getattr(target, method)(*args, **kwargs)
        except Exception:  # noqa: BLE001 - rank 0 meets the same error in the same call
            log.exception("a published %s failed on this rank as on rank 0", method)
