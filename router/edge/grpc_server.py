"""The router's public gRPC server: GenerationService, health, reflection, request ids, drain."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import signal
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine.heap import freeze_startup_heap
from pdserve.v1 import admin_pb2_grpc
from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import generation_pb2_grpc as pb_grpc
from router.edge.admin import ADMIN_SERVICE, AdminServicer
from router.edge.health import HealthServicer
from router.edge.request_ids import RequestIdInterceptor
from router.edge.security import EdgeSecurity
from router.edge.servicer import GenerationServicer
from router.fleet import port_holds
from router.observability.metrics import RouterMetrics
from router.observability.metrics_edge import MetricsInterceptor
from router.serving.protocol import Generator

logger = logging.getLogger(__name__)

GENERATION_SERVICE = pb.DESCRIPTOR.services_by_name["GenerationService"].full_name
DEFAULT_PORT = 50051
# After a drain's grace: how long calls get to write their final ABORT message.
_ABORT_FLUSH_S = 2.0


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class GrpcServer:
    """Owns the grpc.aio server; NOT_SERVING until `set_serving()`, and again while draining."""

    def __init__(
        self,
        generator: Generator,
        *,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        drain_grace_s: float = 30.0,
        drain_notice_s: float = 0.0,
        security: EdgeSecurity | None = None,
        metrics: RouterMetrics | None = None,
        admin: admin_pb2_grpc.AdminServiceServicer | None = None,
        on_drain: Callable[[], None] | None = None,
        reuse_port: bool = False,
    ) -> None:
        self._generator = generator
        # Share the port with the router tier's other processes (SO_REUSEPORT): the
        # kernel spreads new connections over every process listening on it.
        self.reuse_port = reuse_port
        self._on_drain = on_drain  # told first when a drain starts
        self._admin: admin_pb2_grpc.AdminServiceServicer = admin or AdminServicer(
            lambda: None, enabled=False
        )
        self.security = security or EdgeSecurity()
        self.metrics = metrics
        self._host = host
        self._requested_port = port
        self.drain_grace_s = drain_grace_s
        # Time between NOT_SERVING and refusing new calls, so load balancers and
        # readiness probes stop routing here first (set to the probe period in k8s).
        self.drain_notice_s = drain_notice_s
        self._servicer = GenerationServicer(generator)
        self._health = HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._port: int | None = None
        self._stop_task: asyncio.Task[None] | None = None
        self._stop_now = asyncio.Event()
        self._serving = False
        self._stop_now_reason: str | None = None
        self._signalled = False
        self._signal_seen = asyncio.Event()

    @property
    def port(self) -> int:
        """The bound port (the real one when constructed with port 0)."""
        if self._port is None:
            raise RuntimeError("server not started")
        return self._port

    @property
    def address(self) -> str:
        """host:port to dial."""
        return _host_port(self._host, self.port)

    async def start(self) -> int:
        """Bind, register services, start; health stays NOT_SERVING. Returns the bound port."""
        # Metrics first, so they count the auth interceptor's refusals too.
        metrics = [MetricsInterceptor(self.metrics)] if self.metrics is not None else []
        server = grpc.aio.server(
            interceptors=[*metrics, *self.security.interceptors(), RequestIdInterceptor()],
            # grpc sets SO_REUSEPORT by default, which lets a second server bind an
            # occupied port silently and steal half the traffic; fail loudly instead,
            # unless the port is the router tier's to share.
            options=[
                ("grpc.so_reuseport", 1 if self.reuse_port else 0),
                *self.security.server_options(),
            ],
        )
        pb_grpc.add_GenerationServiceServicer_to_server(self._servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        admin_pb2_grpc.add_AdminServiceServicer_to_server(self._admin, server)
        reflection.enable_server_reflection(
            (
                GENERATION_SERVICE,
                ADMIN_SERVICE,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            server,
        )
        for service in ("", GENERATION_SERVICE):
            await self._health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        target = _host_port(self._host, self._requested_port)
        self.security.warn_if_exposed(self._host)
        credentials = self.security.server_credentials()
        port_holds.release(self._host, self._requested_port)  # held since before Ray
        try:
            if credentials is None:
                port = server.add_insecure_port(target)
            else:
                port = server.add_secure_port(target, credentials)
        except RuntimeError as exc:
            raise OSError(f"cannot bind gRPC server to {target}: {exc}") from exc
        if port == 0:  # older grpc reports a failed bind this way
            raise OSError(f"cannot bind gRPC server to {target}")
        await server.start()
        self._server, self._port = server, port
        logger.info("gRPC server listening on %s", self.address)
        return port

    async def set_serving(self) -> None:
        """Report SERVING (call once the pools are warm); ignored after a drain started."""
        for service in ("", GENERATION_SERVICE):
            await self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self._serving = self._stop_task is None

    @property
    def is_serving(self) -> bool:
        """The health check answers SERVING: warm, and no drain has started."""
        return self._serving

    @property
    def num_in_flight(self) -> int:
        """Generate calls being handled right now."""
        return self._servicer.num_in_flight

    async def stop(self, grace: float | None = None) -> None:
        """Drain: NOT_SERVING, notice period, refuse new Generates, wait `grace`, then stop.

        The wait tracks Generate calls only: grpc's own `stop(grace)` would also
        wait for long-lived health Watch streams and so always take the full grace.
        Calls still running when the grace ends get a final ABORT message naming the
        reason; their core streams are closed (blocks are released by the core's cleanup).
        """
        if self._server is None:
            return
        # Idempotent: a signal, the owner and `serve()`'s cleanup may all ask; the
        # first drain wins and later callers wait for it.
        if self._stop_task is None:
            self._stop_task = asyncio.get_running_loop().create_task(self._drain(grace))
        await asyncio.shield(self._stop_task)

    async def _drain(self, grace: float | None) -> None:
        assert self._server is not None
        grace = self.drain_grace_s if grace is None else grace
        self._serving = False
        if self._on_drain is not None:
            self._on_drain()
        await self._health.enter_graceful_shutdown()
        logger.info(
            "draining: %d in flight, notice %.1fs, grace %.1fs",
            self.num_in_flight,
            self.drain_notice_s,
            grace,
        )
        if self.drain_notice_s > 0:
            await self._wait_unless_stopped_now(self._stop_now.wait(), self.drain_notice_s)
        self._servicer.start_draining()
        if self.num_in_flight and not await self._wait_unless_stopped_now(
            self._servicer.wait_idle(), grace
        ):
            stopped_now = self._stop_now.is_set()
            why = (
                (self._stop_now_reason or "stopped at once by a second signal")
                if stopped_now
                else None
            )
            await self._abort_in_flight(why or f"drain grace of {grace:g}s is over")
        # A short grace, not 0: a call whose handler has just returned its final message
        # may still have it (and its status) on the way out, and stop(0) would cancel it
        # first (the client would see UNAVAILABLE instead of its final message). Calls
        # that are still running were given their ABORT above, so nothing waits longer.
        await self._server.stop(_ABORT_FLUSH_S)

    async def _wait_unless_stopped_now(self, waiter: Awaitable[Any], timeout: float) -> bool:
        """Await `waiter` for up to `timeout`; False on timeout or stop_now()."""
        tasks = {asyncio.ensure_future(waiter), asyncio.ensure_future(self._stop_now.wait())}
        done, pending = await asyncio.wait(
            tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
        for task in pending:
            task.cancel()
        return bool(done) and not self._stop_now.is_set()

    async def _abort_in_flight(self, why: str) -> None:
        """Give every call still running its final ABORT message, then let it return."""
        logger.warning("%s: ending %d calls with ABORT", why, self.num_in_flight)
        self._servicer.abort_in_flight(f"server shutting down: {why}")
        # Each handler only writes one message now; a client that does not read cannot
        # hold the shutdown.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._servicer.wait_idle(), timeout=_ABORT_FLUSH_S)

    def request_stop(self) -> None:
        """Start a drain from synchronous code (signal handlers); idempotent."""
        if self._server is not None and self._stop_task is None:
            self._stop_task = asyncio.get_running_loop().create_task(self._drain(None))

    def stop_now(self, reason: str | None = None) -> None:
        """Cut a drain short: no notice, no grace; in-flight calls end with ABORT at once
        (naming `reason`, by default the second signal)."""
        self._stop_now_reason = reason
        self._stop_now.set()
        self.request_stop()

    @property
    def stopped_by_signal(self) -> bool:
        """A SIGTERM or SIGINT asked this server to stop."""
        return self._signalled

    def on_late_signal(self, sig: signal.Signals) -> None:
        """A stop signal once the server has stopped: noted (the stop was asked for), so
        a service whose Ray went down first under the same signal still exits 0."""
        self._signalled = True
        self._signal_seen.set()
        logger.info("%s: already stopping", sig.name)

    async def wait_for_signal(self, timeout_s: float) -> bool:
        """Whether a stop signal came, waiting up to `timeout_s` for one."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._signal_seen.wait(), timeout_s)
        return self._signalled

    def _on_signal(self) -> None:
        # The first SIGTERM/SIGINT drains; another one means "stop now", as users expect.
        self._signalled = True
        self._signal_seen.set()
        if self._stop_task is None:
            self.request_stop()
        else:
            logger.warning("second signal: stopping without waiting for in-flight requests")
            self.stop_now()

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT start a drain; a second signal ends it at once."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal)

    async def wait_for_termination(self) -> None:
        """Return once the server has stopped (after `stop()` or a signal-triggered drain)."""
        if self._server is None:
            return
        await self._server.wait_for_termination()
        if self._stop_task is not None:
            await self._stop_task


async def serve(
    generator: Generator,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    *,
    drain_grace_s: float = 30.0,
    drain_notice_s: float = 0.0,
    warm_up: Awaitable[None] | None = None,
    on_started: Callable[[GrpcServer], None] | None = None,
    security: EdgeSecurity | None = None,
    metrics: RouterMetrics | None = None,
    admin: admin_pb2_grpc.AdminServiceServicer | None = None,
    on_drain: Callable[[], None] | None = None,
    reuse_port: bool = False,
) -> None:
    """Run until SIGTERM/SIGINT has drained the server; the caller then stops the workers.

    The server listens (NOT_SERVING) while `warm_up` runs, so probes see the
    process early; SERVING follows once `warm_up` completes, after the process's heap is
    frozen out of the garbage collector's sight (`engine.heap`). Like the signal
    handlers, that is the whole process's: this runs a service process.
    """
    server = GrpcServer(
        generator,
        host=host,
        port=port,
        drain_grace_s=drain_grace_s,
        drain_notice_s=drain_notice_s,
        security=security,
        metrics=metrics,
        admin=admin,
        on_drain=on_drain,
        reuse_port=reuse_port,
    )
    try:
        await server.start()
    except BaseException:
        if inspect.iscoroutine(warm_up):
            warm_up.close()  # never started: no "coroutine was never awaited" warning
        raise
    server.install_signal_handlers()
    if on_started is not None:
        on_started(server)
    warm_task = asyncio.ensure_future(warm_up) if warm_up is not None else None
    try:
        if warm_task is not None:
            done = asyncio.ensure_future(server.wait_for_termination())
            await asyncio.wait({warm_task, done}, return_when=asyncio.FIRST_COMPLETED)
            if warm_task.done():
                warm_task.result()  # a failed warm-up fails startup loudly
                freeze_startup_heap()
                await server.set_serving()
            await done
        else:
            freeze_startup_heap()
            await server.set_serving()
            await server.wait_for_termination()
    finally:
        if warm_task is not None and not warm_task.done():
            warm_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await warm_task
        await server.stop(0)
        # A stop signal from now on (a service manager signalling every process, one by
        # one) finds the process already stopping: noted, not fatal, until the loop
        # closes, so the stop's last steps (the workers, Ray) are not cut short.
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, server.on_late_signal, sig)
