"""Security at the gRPC edge: TLS (optionally mutual), bearer tokens, message-size limits.

Health and reflection stay open without a token so that probes (grpc_health_probe,
kubelet, load balancers) and tooling keep working; TLS, when on, covers every service.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from router.edge.message_limit import MessageLimitInterceptor, ceiling_bytes

log = logging.getLogger(__name__)

AUTH_HEADER = "authorization"
# Services reachable without a token (full names as in the RPC path).
OPEN_SERVICES = (
    "grpc.health.v1.Health",
    "grpc.reflection.v1alpha.ServerReflection",
    "grpc.reflection.v1.ServerReflection",
)
DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024


def read_tokens(path: str) -> tuple[str, ...]:
    """Tokens in a file, one per line (several allow rotation); blank lines and # ignored."""
    lines = Path(path).read_text().splitlines()
    tokens = tuple(t.strip() for t in lines if t.strip() and not t.strip().startswith("#"))
    if not tokens:
        raise ValueError(f"auth token file {path} holds no token")
    return tokens


@dataclass(frozen=True)
class EdgeSecurity:
    """How the router's gRPC port is protected; the defaults are plaintext and open."""

    tls_cert: str | None = None  # PEM server certificate (chain)
    tls_key: str | None = None  # PEM private key of tls_cert
    tls_client_ca: str | None = None  # PEM CA bundle: clients must present a cert it signed
    auth_token_file: str | None = None  # bearer tokens, one per line
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # per request and response message

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key must be given together")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("--tls-client-ca (mTLS) needs --tls-cert and --tls-key")
        if self.max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be >= 1024, got {self.max_message_bytes}")
        for name in ("tls_cert", "tls_key", "tls_client_ca", "auth_token_file"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise ValueError(f"--{name.replace('_', '-')}: no such file: {path}")

    @property
    def uses_tls(self) -> bool:
        return self.tls_cert is not None

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """TLS credentials for the listening port, or None for plaintext."""
        if not self.uses_tls:
            return None
        assert self.tls_cert is not None and self.tls_key is not None
        key, cert = Path(self.tls_key).read_bytes(), Path(self.tls_cert).read_bytes()
        client_ca = Path(self.tls_client_ca).read_bytes() if self.tls_client_ca else None
        return grpc.ssl_server_credentials(
            [(key, cert)],
            root_certificates=client_ca,
            require_client_auth=client_ca is not None,
        )

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        """The message-size limit, then the auth interceptor when a token file is set."""
        limit = MessageLimitInterceptor(self.max_message_bytes)
        if not self.auth_token_file:
            return [limit]
        return [limit, BearerTokenInterceptor(read_tokens(self.auth_token_file))]

    def server_options(self) -> list[tuple[str, Any]]:
        """grpc server options for the message-size limit: responses at the limit; requests
        at its ceiling (router/edge/message_limit.py refuses those over the limit, counted)."""
        return [
            ("grpc.max_receive_message_length", ceiling_bytes(self.max_message_bytes)),
            ("grpc.max_send_message_length", self.max_message_bytes),
        ]

    def warn_if_exposed(self, host: str) -> None:
        """Log a warning when a non-loopback address is served with neither TLS nor tokens."""
        if self.uses_tls or self.auth_token_file or is_loopback(host):
            return
        log.warning(
            "serving gRPC on %s without TLS or authentication: anyone who can reach this "
            "address can generate; pass --tls-cert/--tls-key and/or --auth-token-file",
            host,
        )


def is_loopback(host: str) -> bool:
    """True for localhost and loopback IPs; False for wildcard and other addresses."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without `authorization: Bearer <token>` with UNAUTHENTICATED."""

    def __init__(self, tokens: tuple[str, ...]) -> None:
        self._tokens = tuple(t.encode() for t in tokens)

    def _allowed(self, metadata: Any) -> bool:
        for key, value in metadata or ():
            if key != AUTH_HEADER or not isinstance(value, str):
                continue
            scheme, _, token = value.partition(" ")
            if scheme.lower() != "bearer":
                continue
            # Compare against every token so timing does not reveal which one matched.
            matches = [hmac.compare_digest(token.strip().encode(), t) for t in self._tokens]
            if any(matches):
                return True
        return False

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        service = handler_call_details.method.lstrip("/").split("/", 1)[0]
        if service in OPEN_SERVICES or self._allowed(handler_call_details.invocation_metadata):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        return _refusing_handler(handler)


async def _refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(
        grpc.StatusCode.UNAUTHENTICATED,
        "missing or invalid bearer token (metadata 'authorization: Bearer <token>')",
    )


def _refusing_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that answers UNAUTHENTICATED."""
    deserialize, serialize = handler.request_deserializer, handler.response_serializer
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_refuse, deserialize, serialize)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_refuse, deserialize, serialize)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_refuse, deserialize, serialize)
    return grpc.unary_unary_rpc_method_handler(_refuse, deserialize, serialize)
