"""The router's grpc.health.v1 servicer: grpc's asyncio one, plus `List`.

grpcio-health-checking's asyncio servicer (1.85) answers `List` with UNIMPLEMENTED while
reflection lists the method; here it answers with every service the server registered a
status for, each as `Check` would answer it.
"""

from __future__ import annotations

from typing import Any

from grpc_health.v1 import health, health_pb2


class HealthServicer(health.aio.HealthServicer):
    """Check, Watch and graceful shutdown as grpc implements them; List over the same."""

    def __init__(self) -> None:
        super().__init__()
        self._services = {""}  # grpc's servicer starts with the server itself
        self._closed = False

    async def set(self, service: str, status: health_pb2.HealthCheckResponse.ServingStatus) -> None:
        """Set a service's status (ignored once a graceful shutdown began, as in grpc)."""
        if not self._closed:
            self._services.add(service)
        await super().set(service, status)

    async def enter_graceful_shutdown(self) -> None:
        """Every service NOT_SERVING, for good."""
        self._closed = True
        await super().enter_graceful_shutdown()

    async def List(
        self, request: health_pb2.HealthListRequest, context: Any
    ) -> health_pb2.HealthListResponse:
        """Every known service's status, as `Check` answers each."""
        statuses = {}
        for service in sorted(self._services):
            check = health_pb2.HealthCheckRequest(service=service)
            statuses[service] = await self.Check(check, context)
        return health_pb2.HealthListResponse(statuses=statuses)
