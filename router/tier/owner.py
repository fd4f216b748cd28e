"""The fleet owner's side of a router tier: it starts the other router processes, keeps
them running, and tells them what they need.

Router process 0 is the service's main process: it keeps everything it does without a
tier (Ray, the KV rendezvous, the pools, restarts, scaling, the planner, live migration,
the admin API) and serves calls like the others. Once its pools are up it starts
processes 1..N-1 (`python -m router.tier.child`), each of which connects back over the
tier's control socket, gets its `Bootstrap` and from then on every change of the fleet
(`Membership`, router/tier/membership.py). A process that exits while the service runs
is started again at once (after a short backoff when it keeps failing: never more than
`MAX_RESTART_DELAY_S`); its slot in the shared admission table is cleared as it dies,
and the requests it had are kept by their decode workers for a resumed stream to take
over (decode_worker/outboxes.py). On a stop the owner tells every process to drain
and waits for them before it stops the workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Listener
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.log_setup import LOG_LEVEL_ENV, current_level
from router.fleet import port_holds
from router.tier.membership import Membership
from router.tier.messages import (
    Bootstrap,
    Drain,
    Hello,
    LinkPeers,
    Listening,
    Rebalanced,
    SignalsReport,
)
from router.tier.shared_admission import AdmissionTable
from router.tier.shared_load import LoadTable

if TYPE_CHECKING:
    from router.config import ServeConfig

log = logging.getLogger(__name__)

SUPERVISE_EVERY_S = 0.2
# A process that dies within this long of its start is failing: its next start waits.
QUICK_DEATH_S = 10.0
MAX_RESTART_DELAY_S = 3.0
# After a drain: how long the processes get beyond the grace before they are killed.
STOP_MARGIN_S = 5.0
_REPO_ROOT = str(Path(__file__).resolve().parents[2])


def consumer_name(index: int) -> str:
    """A router process's name on the workers: its index and a tag new at each start, so
    a restarted process is a new consumer (the old one's requests stay orphans)."""
    return f"router-{index}-{secrets.token_hex(3)}"


@dataclass(eq=False)
class _Child:
    index: int
    proc: subprocess.Popen[bytes]
    consumer: str
    started_at: float
    conn: Connection | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    quick_deaths: int = 0
    listening: bool = False

    def send(self, message: Any) -> bool:
        with self.lock:
            if self.conn is None:
                return False
            try:
                self.conn.send(message)
                return True
            except (OSError, ValueError):
                return False


class TierOwner:
    """Starts, restarts, informs and stops router processes 1..N-1."""

    def __init__(self, config: ServeConfig, port: int, call_token: bytes) -> None:
        self.config = config
        self.num_processes = config.router_processes
        self.port = port
        self._call_token = call_token
        self.dir = tempfile.mkdtemp(prefix="pdserve-tier-")  # mode 0700
        self.table = AdmissionTable(
            os.path.join(self.dir, "admission"), self.num_processes, create=True
        )
        self.load_table = LoadTable(os.path.join(self.dir, "load"), self.num_processes, create=True)
        self.admin_address = f"unix:{os.path.join(self.dir, 'admin.sock')}"
        self._authkey = secrets.token_bytes(32)
        self._control_path = os.path.join(self.dir, "control.sock")
        self._listener: Listener | None = None
        self._children: dict[int, _Child] = {}
        self._membership: Membership | None = None
        self._stopping = False
        self._supervisor: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.num_restarts = 0
        # Each process's latest traffic report, for the planner (router/tier/signals_relay.py).
        self.on_report: list[Any] = []
        # A process asks for a channel between decode workers: (its index, the request).
        self.on_link_request: Callable[[int, LinkPeers], None] | None = None
        # A process answers a move of its requests (router/tier/rebalance.py).
        self.on_rebalanced: Callable[[int, Rebalanced], None] | None = None

    # ---------------------------------------------------------------- start
    async def start(self) -> None:
        """Listen for the processes, then start them: they import what they need while
        the pools start, and wait for the first membership before they listen."""
        self._loop = asyncio.get_running_loop()
        self._listener = Listener(self._control_path, family="AF_UNIX", authkey=self._authkey)
        threading.Thread(target=self._accept, name="tier-accept", daemon=True).start()
        for index in range(1, self.num_processes):
            self._spawn(index)
        self._supervisor = asyncio.ensure_future(self._supervise())
        log.info("router tier: %d processes on port %d", self.num_processes, self.port)

    def _spawn(self, index: int) -> None:
        config = self.config
        if config.metrics_port:
            # Held since start, so Ray's processes could not take it (router/fleet/port_holds.py).
            port_holds.release(config.metrics_host, config.metrics_port + index)
        env = dict(os.environ)
        env[LOG_LEVEL_ENV] = current_level()
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO_ROOT, env.get("PYTHONPATH", "")) if p)
        proc = subprocess.Popen(
            [sys.executable, "-m", "router.tier.child"], stdin=subprocess.PIPE, env=env
        )
        assert proc.stdin is not None
        secret = {"address": self._control_path, "authkey": self._authkey.hex(), "index": index}
        with contextlib.suppress(OSError):
            proc.stdin.write(json.dumps(secret).encode())
            proc.stdin.close()
        old = self._children.get(index)
        child = _Child(index, proc, consumer_name(index), time.monotonic())
        if old is not None:
            child.quick_deaths = old.quick_deaths
        self._children[index] = child
        log.info("router process %d started (pid %d)", index, proc.pid)

    def _accept(self) -> None:
        """Control-socket thread: each process's hello, its bootstrap, then its reports."""
        assert self._listener is not None
        while True:
            try:
                conn = self._listener.accept()
            except (OSError, EOFError):
                return  # closed: the tier is stopping
            except Exception as exc:  # noqa: BLE001 - a failed handshake: not ours
                log.warning("router tier: refused a connection: %r", exc)
                continue
            threading.Thread(
                target=self._serve_child, args=(conn,), name="tier-child", daemon=True
            ).start()

    def _serve_child(self, conn: Connection) -> None:
        try:
            hello = conn.recv()
        except (OSError, EOFError):
            conn.close()
            return
        child = self._children.get(hello.index) if isinstance(hello, Hello) else None
        if child is None or child.proc.pid != hello.pid:
            conn.close()
            return
        boot = Bootstrap(
            config=self.config,
            num_processes=self.num_processes,
            port=self.port,
            call_token=self._call_token,
            consumer=child.consumer,
            admission_table=self.table.path,
            load_table=self.load_table.path,
            admin_address=self.admin_address,
        )
        with child.lock:
            try:
                conn.send(boot)
                if self._membership is not None:
                    conn.send(self._membership)
                if self._stopping:
                    conn.send(Drain("the service is stopping"))
            except (OSError, ValueError):
                conn.close()
                return
            child.conn = conn
        while True:
            try:
                message = conn.recv()
            except (OSError, EOFError):
                return  # the process exited; the supervisor sees it
            if isinstance(message, Listening):
                child.listening = True
                log.info("router process %d (pid %d) is listening", child.index, child.proc.pid)
            elif isinstance(message, SignalsReport) and self._loop is not None:
                for report in self.on_report:
                    self._loop.call_soon_threadsafe(report, hello.index, message)
            elif isinstance(message, LinkPeers) and self._loop and self.on_link_request:
                self._loop.call_soon_threadsafe(self.on_link_request, hello.index, message)
            elif isinstance(message, Rebalanced) and self._loop and self.on_rebalanced:
                self._loop.call_soon_threadsafe(self.on_rebalanced, hello.index, message)

    # ---------------------------------------------------------------- running
    def publish(self, membership: Membership) -> None:
        """Send the fleet to every process, if it changed."""
        if membership == self._membership:
            return
        self._membership = membership
        for child in list(self._children.values()):
            child.send(membership)

    def connected(self) -> list[int]:
        """The indexes of the processes on the line now."""
        return sorted(c.index for c in list(self._children.values()) if c.conn is not None)

    def tell_one(self, message: Any, index: int) -> bool:
        """Send `message` to process `index`: whether it went."""
        child = self._children.get(index)
        return child is not None and child.send(message)

    def tell(self, message: Any, index: int | None = None) -> None:
        """Send `message` to process `index`, or to every process."""
        for child in list(self._children.values()):
            if index is None or child.index == index:
                child.send(message)

    async def _supervise(self) -> None:
        while not self._stopping:
            await asyncio.sleep(SUPERVISE_EVERY_S)
            for child in list(self._children.values()):
                code = child.proc.poll()
                if code is None or self._stopping:
                    continue
                self.table.clear(child.index)  # its slots went with it
                self.load_table.clear(child.index)
                with child.lock:
                    if child.conn is not None:
                        child.conn.close()
                        child.conn = None
                lived = time.monotonic() - child.started_at
                child.quick_deaths = child.quick_deaths + 1 if lived < QUICK_DEATH_S else 0
                delay = min(MAX_RESTART_DELAY_S, 0.5 * (2 ** (child.quick_deaths - 1)))
                delay = delay if child.quick_deaths else 0.0
                log.error(
                    "router process %d (pid %d) exited with %s after %.1f s; starting it again%s",
                    child.index,
                    child.proc.pid,
                    code,
                    lived,
                    f" in {delay:.1f} s" if delay else "",
                )
                self.num_restarts += 1
                del self._children[child.index]
                asyncio.ensure_future(self._respawn_after(child, delay))

    async def _respawn_after(self, child: _Child, delay: float) -> None:
        await asyncio.sleep(delay)
        if self._stopping:
            return
        self._children[child.index] = child  # carries its quick-death count over
        self._spawn(child.index)

    async def wait_listening(self, timeout_s: float) -> bool:
        """Wait until every process takes calls (the service turns SERVING after it, so
        the kernel's first connections are spread over all of them); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            children = [self._children.get(i) for i in range(1, self.num_processes)]
            if all(c is not None and c.listening for c in children):
                return True
            await asyncio.sleep(0.05)
        log.warning("router processes not all listening after %.0f s; serving anyway", timeout_s)
        return False

    def pids(self) -> dict[int, int]:
        """Each running process's pid, by index (tests, and `pdserve workers`' log)."""
        return {i: c.proc.pid for i, c in self._children.items() if c.proc.poll() is None}

    # ---------------------------------------------------------------- stop
    def begin_drain(self, reason: str) -> None:
        """No more restarts; every process drains."""
        if self._stopping:
            return
        self._stopping = True
        for child in list(self._children.values()):
            child.send(Drain(reason))

    async def stop(self, grace_s: float) -> None:
        """Drain them (if not yet), wait for them to exit, then clean up."""
        self.begin_drain("the service is stopping")
        if self._supervisor is not None:
            self._supervisor.cancel()
        deadline = time.monotonic() + grace_s + STOP_MARGIN_S
        while time.monotonic() < deadline:
            if all(c.proc.poll() is not None for c in self._children.values()):
                break
            await asyncio.sleep(0.05)
        for child in self._children.values():
            if child.proc.poll() is None:
                log.warning("router process %d did not stop; killing it", child.index)
                child.proc.kill()
        for child in self._children.values():
            with contextlib.suppress(Exception):
                await asyncio.get_running_loop().run_in_executor(None, child.proc.wait, 5)
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.close()
        self.table.close()
        self.load_table.close()
        shutil.rmtree(self.dir, ignore_errors=True)
