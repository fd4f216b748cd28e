"""The router's calls to a worker over a TCP connection of their own, not Ray's.

A Ray actor call's round trip costs milliseconds on one host, even to an empty async
method, and a request waits for one to its prefill worker before its first token is in
the router's hands. Ray still places, starts,
watches and stops every worker; once started, a worker also listens here and the router
sends each of its verbs (prefill, reserve, next_tokens, ...) over one connection per
worker: frames of a length and a pickle, a call id to match each reply, every call run
as a task of its own on the worker's event loop, in the order the calls arrived (as Ray
starts an async actor's calls), so a long poll does not hold up the calls behind it.

The connection is authenticated by a random token the router hands each worker through
Ray when it starts it: frames are pickles, so an unauthenticated peer must not get to
send one (the same trust as Ray's own ports inside a cluster). A worker on the router's
node listens on the loopback address only; on another node, on that node's address.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import logging
import pickle
import struct
from collections.abc import Collection
from typing import Any

log = logging.getLogger(__name__)

_LENGTH = struct.Struct("!I")
TOKEN_BYTES = 32
MAX_FRAME_BYTES = 1 << 30
# How long a connecting router may take to authenticate.
AUTH_TIMEOUT_S = 10.0


class CallsLost(ConnectionError):
    """The connection to the worker is gone: the worker died or stopped."""


async def _read_frame(reader: asyncio.StreamReader) -> Any:
    (size,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if size > MAX_FRAME_BYTES:
        raise ValueError(f"frame of {size} bytes")
    return pickle.loads(await reader.readexactly(size))


def _frame(obj: Any) -> bytes:
    body = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(body)) + body


class CallServer:
    """The worker's end: runs `getattr(target, verb)(*args)` for each call of `verbs` (its
    kind's, engine/worker/contract.py); any other is refused."""

    def __init__(self, target: object, token: bytes, verbs: Collection[str]) -> None:
        self._target = target
        self._verbs = frozenset(verbs)
        self._token = token
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self, host: str) -> str:
        """Listen on `host` (any free port); returns "host:port"."""
        self._server = await asyncio.start_server(self._serve, host, 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"{host}:{port}"

    async def close(self) -> None:
        """Stop listening and drop every connection, as the worker's process ending does
        (a stopping worker leaves it open: the router drops the worker first)."""
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.close()
        for task in list(self._tasks):
            task.cancel()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            token = await asyncio.wait_for(reader.readexactly(TOKEN_BYTES), AUTH_TIMEOUT_S)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            writer.close()
            return
        if not hmac.compare_digest(token, self._token):
            peer = writer.get_extra_info("peername")
            log.warning("refused a call connection from %s: wrong token", peer)
            writer.close()
            return
        self._writers.add(writer)
        try:
            while True:
                call_id, verb, args = await _read_frame(reader)
                task = asyncio.ensure_future(self._run(writer, call_id, verb, args))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the router went away
        except Exception as exc:  # noqa: BLE001 - a frame that cannot be read: drop the peer
            log.warning("call connection dropped: %r", exc)
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _run(
        self, writer: asyncio.StreamWriter, call_id: int, verb: str, args: tuple[Any, ...]
    ) -> None:
        try:
            if verb not in self._verbs:
                raise AttributeError(f"no call {verb!r} on this worker")
            reply = (call_id, True, await getattr(self._target, verb)(*args))
        except Exception as exc:  # noqa: BLE001 - the caller gets it, as from Ray
            reply = (call_id, False, exc)
        try:
            frame = _frame(reply)
        except Exception as exc:  # noqa: BLE001 - an unpicklable result or error
            frame = _frame((call_id, False, RuntimeError(f"{verb}: {exc!r}")))
        with contextlib.suppress(ConnectionError):
            writer.write(frame)


class CallClient:
    """The router's end: one connection, opened at the first call, shared by all."""

    def __init__(self, address: str, token: bytes) -> None:
        host, _, port = address.rpartition(":")
        self._host, self._port = host, int(port)
        self._token = token
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._connecting: asyncio.Task[asyncio.StreamWriter] | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._lost: str | None = None

    async def call(self, verb: str, *args: Any) -> Any:
        if self._lost is not None:
            raise CallsLost(self._lost)
        writer = self._writer or await self._connect()
        call_id = next(self._ids)
        reply: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = reply
        try:
            writer.write(_frame((call_id, verb, args)))
            return await reply
        finally:
            self._pending.pop(call_id, None)

    async def _connect(self) -> asyncio.StreamWriter:
        if self._lost is not None:
            raise CallsLost(self._lost)
        if self._connecting is None:  # every caller until it is up waits for one attempt
            self._connecting = asyncio.ensure_future(self._open())
        return await asyncio.shield(self._connecting)

    async def _open(self) -> asyncio.StreamWriter:
        try:
            reader, writer = await asyncio.open_connection(self._host, self._port)
        except OSError as exc:
            self._lose(f"cannot reach {self._host}:{self._port}: {exc}")
            raise CallsLost(self._lost or "") from exc
        writer.write(self._token)
        self._reader_task = asyncio.ensure_future(self._read_replies(reader))
        self._writer = writer
        return writer

    async def _read_replies(self, reader: asyncio.StreamReader) -> None:
        why = "connection closed by the worker"
        try:
            while True:
                call_id, ok, value = await _read_frame(reader)
                reply = self._pending.get(call_id)
                if reply is None or reply.done():
                    continue  # its caller was cancelled
                if ok:
                    reply.set_result(value)
                else:
                    reply.set_exception(value)
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            why = f"connection to the worker lost: {exc!r}"
        except Exception as exc:  # noqa: BLE001 - a reply that cannot be read
            why = f"unreadable reply from the worker: {exc!r}"
        finally:
            self._lose(why)

    def _lose(self, why: str) -> None:
        """Every call in flight and every later one fails with CallsLost."""
        self._lost = self._lost or why
        for reply in self._pending.values():
            if not reply.done():
                reply.set_exception(CallsLost(self._lost))
        if self._writer is not None:
            self._writer.close()

    def close(self) -> None:
        if self._reader_task is not None:
            self._reader_task.cancel()
        self._lose("closed")


def listen_host(node_ip: str, router_ip: str) -> str:
    """Loopback when the router is on this node, else this node's address."""
    return "127.0.0.1" if node_ip == router_ip else node_ip
