"""TLS, mutual TLS, bearer tokens and message limits at the router's gRPC edge.

A real grpc.aio server on loopback with a scripted core; certificates are made per run.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from router.cli.client import ClientSecurity, get_server_info, stream_generate
from router.edge.grpc_server import GrpcServer
from router.edge.security import EdgeSecurity
from tests.fake_core import FakeCore

# The test certificates are made with `cryptography` (a test dependency); an image
# without it skips this module instead of failing to collect it.
pytest.importorskip("cryptography", reason="the test certificates need `cryptography`")
from tests.certs import CertificateAuthority, Issued  # noqa: E402

TOKEN = "s3cret-token-for-tests"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    folder = tmp_path_factory.mktemp("pki")
    ca = CertificateAuthority(folder)
    rogue = CertificateAuthority(folder, "rogue CA")
    tokens = folder / "tokens"
    tokens.write_text(f"# rotated tokens, one per line\nold-token\n{TOKEN}\n")
    return {
        "ca": ca.cert_path,
        "server": ca.issue("server", server=True),
        "client": ca.issue("client", server=False),
        "rogue_ca": rogue.cert_path,
        "rogue_client": rogue.issue("rogue-client", server=False),
        "tokens": tokens,
    }


def with_server(security: EdgeSecurity, body: Callable[[str], Awaitable[None]]) -> None:
    async def main() -> None:
        server = GrpcServer(FakeCore(num_chunks=2), host="127.0.0.1", port=0, security=security)
        await server.start()
        await server.set_serving()
        try:
            await body(server.address)
        finally:
            await server.stop(0)

    asyncio.run(main())


async def generate(address: str, security: ClientSecurity, **kwargs: Any) -> str:
    texts = [
        r.text
        async for r in stream_generate(
            address, prompt="hi", max_tokens=2, timeout=10, security=security, **kwargs
        )
    ]
    return "".join(texts)


async def fails_with(address: str, security: ClientSecurity) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await generate(address, security)
    return info.value.code()


def test_tls_serves_clients_that_trust_its_ca_only(pki: dict) -> None:
    server: Issued = pki["server"]

    async def body(address: str) -> None:
        assert await generate(address, ClientSecurity(tls_ca=str(pki["ca"]))) == "t0 t1 "
        # A plaintext client, and one that trusts another CA, never get a response.
        assert await fails_with(address, ClientSecurity()) == grpc.StatusCode.UNAVAILABLE
        wrong_ca = ClientSecurity(tls_ca=str(pki["rogue_ca"]))
        assert await fails_with(address, wrong_ca) == grpc.StatusCode.UNAVAILABLE

    with_server(EdgeSecurity(tls_cert=str(server.cert), tls_key=str(server.key)), body)


def test_mtls_requires_a_client_certificate_from_the_client_ca(pki: dict) -> None:
    server: Issued = pki["server"]
    client: Issued = pki["client"]
    rogue: Issued = pki["rogue_client"]
    security = EdgeSecurity(
        tls_cert=str(server.cert), tls_key=str(server.key), tls_client_ca=str(pki["ca"])
    )

    async def body(address: str) -> None:
        good = ClientSecurity(
            tls_ca=str(pki["ca"]), tls_cert=str(client.cert), tls_key=str(client.key)
        )
        assert await generate(address, good) == "t0 t1 "
        no_cert = ClientSecurity(tls_ca=str(pki["ca"]))
        assert await fails_with(address, no_cert) == grpc.StatusCode.UNAVAILABLE
        other = ClientSecurity(
            tls_ca=str(pki["ca"]), tls_cert=str(rogue.cert), tls_key=str(rogue.key)
        )
        assert await fails_with(address, other) == grpc.StatusCode.UNAVAILABLE

    with_server(security, body)


def test_token_auth_refuses_missing_or_wrong_tokens_but_not_probes(pki: dict) -> None:
    async def body(address: str) -> None:
        assert await generate(address, ClientSecurity(token=TOKEN)) == "t0 t1 "
        assert await generate(address, ClientSecurity(token="old-token")) == "t0 t1 "
        assert await fails_with(address, ClientSecurity()) == grpc.StatusCode.UNAUTHENTICATED
        wrong = ClientSecurity(token=TOKEN + "x")
        assert await fails_with(address, wrong) == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await get_server_info(address)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert (await get_server_info(address, security=ClientSecurity(token=TOKEN))).model
        async with grpc.aio.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
            request = reflection_pb2.ServerReflectionRequest(list_services="")
            async for reply in reflection.ServerReflectionInfo(iter([request]), timeout=5):
                names = {s.name for s in reply.list_services_response.service}
                assert "pdserve.v1.GenerationService" in names

    with_server(EdgeSecurity(auth_token_file=str(pki["tokens"])), body)


def test_tls_and_token_together(pki: dict) -> None:
    server: Issued = pki["server"]
    security = EdgeSecurity(
        tls_cert=str(server.cert), tls_key=str(server.key), auth_token_file=str(pki["tokens"])
    )

    async def body(address: str) -> None:
        good = ClientSecurity(tls_ca=str(pki["ca"]), token=TOKEN)
        assert await generate(address, good) == "t0 t1 "
        no_token = ClientSecurity(tls_ca=str(pki["ca"]))
        assert await fails_with(address, no_token) == grpc.StatusCode.UNAUTHENTICATED

    with_server(security, body)


def test_oversized_messages_are_refused() -> None:
    async def body(address: str) -> None:
        assert await generate(address, ClientSecurity(), stop=["x"] * 16) == "t0 t1 "
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await generate(address, ClientSecurity(), stop=["x"] * 17)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "at most 16" in (info.value.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await generate(address, ClientSecurity(), stop_token_ids=list(range(65)))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as info:
            big = "word " * 2000  # 10 kB, over the 8 kB limit below
            async for _ in stream_generate(address, prompt=big, max_tokens=2, timeout=10):
                pass
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "larger than max (" in (info.value.details() or "")
        # Every service keeps the limit, whatever the shape of its calls.
        async with grpc.aio.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await health.Check(health_pb2.HealthCheckRequest(service="s" * 10_000))
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            big = reflection_pb2.ServerReflectionRequest(file_containing_symbol="s" * 10_000)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in stub.ServerReflectionInfo(iter([big])):
                    pass
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            # Far past the limit, gRPC refuses the message itself, the same way.
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await health.Check(health_pb2.HealthCheckRequest(service="s" * 100_000))
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

    with_server(EdgeSecurity(max_message_bytes=8192), body)


def test_bad_settings_are_refused_with_a_reason(tmp_path: Path, pki: dict) -> None:
    server: Issued = pki["server"]
    with pytest.raises(ValueError, match="together"):
        EdgeSecurity(tls_cert=str(server.cert))
    with pytest.raises(ValueError, match="mTLS"):
        EdgeSecurity(tls_client_ca=str(pki["ca"]))
    with pytest.raises(ValueError, match="no such file"):
        EdgeSecurity(auth_token_file=str(tmp_path / "missing"))
    empty = tmp_path / "empty"
    empty.write_text("\n# nothing\n")
    with pytest.raises(ValueError, match="no token"):
        EdgeSecurity(auth_token_file=str(empty)).interceptors()


def test_plaintext_on_a_public_address_warns(pki: dict, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="router.edge.security")
    for host in ("127.0.0.1", "localhost", "::1"):
        EdgeSecurity().warn_if_exposed(host)
    EdgeSecurity(auth_token_file=str(pki["tokens"])).warn_if_exposed("0.0.0.0")
    assert not caplog.records
    EdgeSecurity().warn_if_exposed("0.0.0.0")
    assert len(caplog.records) == 1
    assert "without TLS or authentication" in caplog.records[0].getMessage()


# A TLS server on loopback probed with plaintext, first as a gRPC client, then as raw bytes.
_PLAINTEXT_PROBE = """
import asyncio, socket, sys
from router.edge.grpc_server import GrpcServer
from router.edge.security import EdgeSecurity
from tests.fake_core import FakeCore
import grpc

async def main() -> None:
    security = EdgeSecurity(tls_cert=sys.argv[1], tls_key=sys.argv[2])
    server = GrpcServer(FakeCore(num_chunks=2), host="127.0.0.1", port=0, security=security)
    await server.start()
    await server.set_serving()
    async with grpc.aio.insecure_channel(server.address) as channel:
        try:
            await asyncio.wait_for(channel.channel_ready(), 1.0)
        except asyncio.TimeoutError:
            print("plaintext client refused")
    host, port = server.address.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as probe:
        probe.sendall(b"GET / HTTP/1.1\\r\\n\\r\\n")
        probe.recv(64)
    await asyncio.sleep(0.3)
    await server.stop(0)

asyncio.run(main())
"""


@pytest.mark.parametrize("verbosity", [None, "INFO"])
def test_a_plaintext_probe_of_the_tls_port_logs_nothing_unless_asked(
    pki: dict, verbosity: str | None
) -> None:
    server: Issued = pki["server"]
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    if verbosity:
        env["GRPC_VERBOSITY"] = verbosity  # the operator asks for gRPC's own lines
    repo = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = str(repo)
    proc = subprocess.run(
        [sys.executable, "-c", _PLAINTEXT_PROBE, str(server.cert), str(server.key)],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "plaintext client refused\n"
    assert ("Handshake failed" in proc.stderr) == (verbosity == "INFO"), proc.stderr
