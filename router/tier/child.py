"""A router process of a router tier other than the fleet owner:
`python -m router.tier.child`, started by the owner (router/tier/owner.py), which
writes where to reach it (its control socket, the key, this process's index) on stdin.

It serves the same GenerationService as the owner, on the same port (SO_REUSEPORT:
the kernel spreads new connections over every process listening), with a serving core
of its own over a read-only view of the owner's pools (router/tier/pools_view.py): its
own event loop, its own connections to every worker and its own token delivery (its
requests' updates come to its own outbox on each decode worker). Admission is the
tier's shared budget (router/tier/shared_admission.py); AdminService calls are
forwarded to the owner (router/tier/admin_proxy.py); /metrics is its own, on the
metrics port plus its index. It listens only once its core can route, so the kernel
never hands a connection to a process that would refuse it. It drains and exits on
SIGTERM/SIGINT or when the owner says so, and stops at once (each stream with its
ABORT message) if the owner goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import Client, Connection
from typing import TYPE_CHECKING, Any

from engine import tracing
from engine.log_setup import LOG_FORMAT, LOG_LEVEL_ENV
from router.tier.membership import Membership
from router.tier.messages import (
    Bootstrap,
    Drain,
    Hello,
    LinkPeers,
    Listening,
    PeersLinked,
    Rebalance,
)

if TYPE_CHECKING:  # serving's imports take seconds: after the line to the owner is up
    from router.tier.pools_view import LinkAsker

log = logging.getLogger(__name__)

READY_WAIT_S = 60.0  # for the first routable workers, before listening anyway


class OwnerLink:
    """This process's end of the control socket."""

    def __init__(self, address: str, authkey: bytes, index: int) -> None:
        self._conn: Connection = Client(address, family="AF_UNIX", authkey=authkey)
        self._lock = threading.Lock()
        self._conn.send(Hello(index, os.getpid()))
        boot = self._conn.recv()
        if not isinstance(boot, Bootstrap):
            raise RuntimeError(f"the fleet owner sent {type(boot).__name__}, not a bootstrap")
        self.bootstrap = boot

    def listen(
        self,
        loop: asyncio.AbstractEventLoop,
        on_message: Callable[[Any], None],
        on_lost: Callable[[], None],
    ) -> None:
        """Hand every message to `on_message` on the loop; `on_lost` when the line ends."""

        def read() -> None:
            while True:
                try:
                    message = self._conn.recv()
                except (OSError, EOFError):
                    loop.call_soon_threadsafe(on_lost)
                    return
                loop.call_soon_threadsafe(on_message, message)

        threading.Thread(target=read, name="tier-owner", daemon=True).start()

    def send(self, message: Any) -> None:
        with self._lock, contextlib.suppress(OSError, ValueError):
            self._conn.send(message)


class _LinkRequests:
    """Channels between decode workers asked of the owner, each awaiting its answer."""

    def __init__(self, send: Callable[[Any], None]) -> None:
        self._send = send
        self._seq = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[str | None]] = {}

    async def ask(self, sender: tuple[str, int], receiver: tuple[str, int]) -> None:
        seq = next(self._seq)
        answer: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self._waiting[seq] = answer
        try:
            self._send(LinkPeers(seq, sender, receiver))
            error = await answer
        finally:
            self._waiting.pop(seq, None)
        if error is not None:
            raise RuntimeError(f"channel {sender[0]} → {receiver[0]} not made: {error}")

    def answered(self, message: PeersLinked) -> None:
        answer = self._waiting.get(message.seq)
        if answer is not None and not answer.done():
            answer.set_result(message.error)

    def owner_lost(self) -> None:
        for answer in self._waiting.values():
            if not answer.done():
                answer.set_result("the fleet owner went away")


class _OwnerNews:
    """What the owner says, as the child hears it: the fleet, a drain, its going away."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.first: asyncio.Future[Membership] = loop.create_future()
        self.handlers: dict[type, Callable[[Any], None]] = {}
        self.owner_lost = asyncio.Event()
        self.drain_asked = asyncio.Event()  # whenever it comes: before serving, it ends the start
        self.latest: Membership | None = None  # the owner's last word on the fleet

    def on_message(self, message: Any) -> None:
        if isinstance(message, Membership):
            self.latest = message
            if not self.first.done():
                self.first.set_result(message)
        if isinstance(message, Drain):
            log.info("draining: %s", message.reason)
            self.drain_asked.set()
        handler = self.handlers.get(type(message))
        if handler is not None:
            handler(message)

    def on_lost(self) -> None:
        self.owner_lost.set()
        if not self.first.done():
            self.first.set_exception(RuntimeError("the fleet owner went away"))

    def stopping(self) -> bool:
        return self.owner_lost.is_set() or self.drain_asked.is_set()


async def run_child(address: str, authkey: bytes, index: int) -> None:
    """Serve as router process `index` until drained, signalled or orphaned."""
    loop = asyncio.get_running_loop()
    link = await loop.run_in_executor(None, OwnerLink, address, authkey, index)
    boot = link.bootstrap
    config = boot.config
    from router.observability.tracing import set_router_process

    set_router_process(index)
    tracing.configure(config.cluster.tracing, "pdserve-router")
    news = _OwnerNews(loop)
    links = _LinkRequests(link.send)
    news.handlers[PeersLinked] = links.answered

    def on_lost() -> None:
        news.on_lost()
        links.owner_lost()

    link.listen(loop, news.on_message, on_lost)
    membership = await news.first
    core, table = await _serving_core(boot, index, membership, news, links.ask, link.send)
    try:
        await _serve(link, boot, index, core, news)
    finally:
        await core.stop()
        tracing.shutdown()
        table.close()
        log.info("router process %d stopped", index)


async def _serving_core(
    boot: Bootstrap,
    index: int,
    membership: Membership,
    news: _OwnerNews,
    ask_link: LinkAsker,
    tell_owner: Callable[[Any], None],
) -> tuple[Any, Any]:
    """This process's serving core over a view of the owner's pools, and the shared
    admission table it counts in (what serving needs takes seconds to import: after
    the line to the owner is up)."""
    from engine.model.model_loader import has_tokenizer, load_tokenizer
    from router.serving.orchestrator import DisaggregatedGenerator
    from router.tier.pools_view import PoolsView
    from router.tier.rebalance import answer_rebalance
    from router.tier.shared_admission import AdmissionTable, SharedAdmission
    from router.tier.shared_load import LoadSharing, LoadTable

    config = boot.config
    view = PoolsView(boot.call_token, boot.consumer, config.resume_grace_s, ask_link=ask_link)
    load_table = LoadTable(boot.load_table, boot.num_processes)
    LoadSharing(load_table, index).follow(view)
    view.apply(membership)
    model_path = config.cluster.decode_args.resolve_model_path()
    tokenizer = None
    if has_tokenizer(model_path):
        loop = asyncio.get_running_loop()
        tokenizer = await loop.run_in_executor(None, load_tokenizer, str(model_path))
    table = AdmissionTable(boot.admission_table, boot.num_processes)
    rc = config.router
    admission = SharedAdmission(
        table,
        index,
        rc.max_in_flight,
        rc.max_queue,
        policy=rc.admission_policy,
        aging_s=rc.priority_aging_s,
    )
    # Channels between decode workers are the owner's to make, as a move needs them.
    core = DisaggregatedGenerator(
        view, tokenizer, replace(rc, decode_peer_channels="lazy"), admission
    )
    core.start()

    def on_rebalance(m: Rebalance) -> None:
        # MigrateRequests or a drain across the tier: this process's requests on the
        # worker move with their KV, as the owner's own do.
        core.calls.spawn(answer_rebalance(m, view.incarnation, core.live_migration, tell_owner))

    news.handlers[Rebalance] = on_rebalance

    def on_membership(m: Membership) -> None:
        view.apply(m)
        if m.prefill_policy is not None and m.prefill_policy != core.prefill_policy:
            core.set_prefill_policy(m.prefill_policy)

    news.handlers[Membership] = on_membership
    if news.latest is not None:
        on_membership(news.latest)  # what changed while this process was getting ready
    return core, table


async def _serve(link: OwnerLink, boot: Bootstrap, index: int, core: Any, news: _OwnerNews) -> None:
    """Listen once the core can route, and serve until drained, signalled or orphaned."""
    from router.edge.grpc_server import GrpcServer, serve
    from router.observability.metrics import get_metrics
    from router.observability.phase_metrics import get_phase_metrics
    from router.tier.admin_proxy import AdminProxy
    from router.tier.signals_relay import report_signals

    config = boot.config
    loop = asyncio.get_running_loop()
    servers: list[GrpcServer] = []

    async def drain_when_asked() -> None:
        await news.drain_asked.wait()
        for server in servers:
            server.request_stop()

    async def stop_if_orphaned() -> None:
        await news.owner_lost.wait()
        log.warning("the fleet owner went away; stopping")
        for server in servers:
            server.stop_now("the fleet owner went away")

    def listening(server: GrpcServer) -> None:
        servers.append(server)
        link.send(Listening())
        if news.drain_asked.is_set():
            server.request_stop()

    tasks = [
        asyncio.ensure_future(stop_if_orphaned()),
        asyncio.ensure_future(drain_when_asked()),
        asyncio.ensure_future(report_signals(core, link.send)),
    ]
    metrics = get_metrics()
    get_phase_metrics()
    stop_metrics = None
    if config.metrics_port:
        stop_metrics = metrics.serve(config.metrics_host, config.metrics_port + index)
    admin = AdminProxy(boot.admin_address)
    deadline = loop.time() + READY_WAIT_S
    while not core.is_ready() and loop.time() < deadline and not news.stopping():
        await asyncio.sleep(0.05)
    try:
        if not news.stopping():
            await serve(
                core,
                config.host,
                boot.port,
                drain_grace_s=config.drain_grace_s,
                on_started=listening,
                security=config.security,
                metrics=metrics,
                admin=admin,
                on_drain=core.begin_shutdown,
                reuse_port=True,
            )
    finally:
        for task in tasks:
            task.cancel()
        await admin.close()
        if stop_metrics is not None:
            stop_metrics()


def main() -> int:
    secret = json.loads(sys.stdin.read())
    index = int(secret["index"])
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(LOG_FORMAT.replace("%(name)s", f"[router {index}] %(name)s"))
    )
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(os.environ.get(LOG_LEVEL_ENV, "INFO").upper())
    try:
        asyncio.run(run_child(secret["address"], bytes.fromhex(secret["authkey"]), index))
    except KeyboardInterrupt:
        return 0
    except Exception as exc:  # noqa: BLE001 - one line for the log; the owner restarts it
        log.error("router process %d failed: %s", index, exc, exc_info=True)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
