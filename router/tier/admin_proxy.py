"""The admin API in a router tier: answered by the fleet owner, wherever a call lands.

Every router process listens on the service's port, so an AdminService call (`pdserve
workers`, `scale`, `prefill-policy`) may reach any of them. The owner answers it: it
serves AdminService, as without a tier, and also on a Unix socket in the tier's private
folder (`serve_owner_admin`), to which every other process forwards the calls it gets
(`AdminProxy`), after its own edge has checked them (tokens, TLS) like any call. A
refusal (PERMISSION_DENIED without --enable-admin, a bad value) comes back as the
owner gave it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from pdserve.v1 import admin_pb2_grpc as pb_grpc
from router.edge.admin import AdminServicer

_METHODS = ("ListWorkers", "ScalePool", "DrainWorker", "MigrateRequests", "SetPrefillPolicy")


async def serve_owner_admin(admin: AdminServicer, address: str) -> grpc.aio.Server:
    """The owner's AdminService on the tier's Unix socket (`unix:PATH`)."""
    server = grpc.aio.server()
    pb_grpc.add_AdminServiceServicer_to_server(admin, server)
    server.add_insecure_port(address)
    await server.start()
    return server


class AdminProxy(pb_grpc.AdminServiceServicer):
    """Forwards every AdminService call to the owner over the tier's Unix socket."""

    def __init__(self, address: str) -> None:
        self._address = address
        self._channel: grpc.aio.Channel | None = None
        self._stub: Any = None
        for name in _METHODS:
            setattr(self, name, self._forwarder(name))

    def _owner(self) -> Any:
        if self._stub is None:
            self._channel = grpc.aio.insecure_channel(self._address)
            self._stub = pb_grpc.AdminServiceStub(self._channel)
        return self._stub

    def _forwarder(self, name: str) -> Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]:
        async def forward(request: Any, context: grpc.aio.ServicerContext) -> Any:
            method = getattr(self._owner(), name)
            try:
                return await method(request, timeout=context.time_remaining())
            except grpc.aio.AioRpcError as exc:
                await context.abort(exc.code(), exc.details() or "")

        forward.__name__ = name
        return forward

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
