"""Small async client for GenerationService, used by the `pdserve generate` CLI and tests."""

from __future__ import annotations

import argparse
import asyncio
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import generation_pb2_grpc as pb_grpc

_SAMPLING_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
)

Message = tuple[str, str] | dict[str, str]
DEFAULT_TARGET = "127.0.0.1:50051"


@dataclass(frozen=True)
class ClientSecurity:
    """How to reach a router that uses TLS, mTLS or bearer tokens; defaults: plaintext."""

    tls: bool = False  # TLS with the system's trusted roots
    tls_ca: str | None = None  # PEM CA bundle that signed the server's certificate (TLS on)
    tls_cert: str | None = None  # PEM client certificate, for a server that requires mTLS
    tls_key: str | None = None  # PEM private key of tls_cert
    tls_server_name: str | None = None  # name to check the certificate against
    token: str | None = None  # bearer token

    @property
    def uses_tls(self) -> bool:
        return self.tls or bool(self.tls_ca or self.tls_cert)

    def channel(self, target: str) -> grpc.aio.Channel:
        """An open channel to `target` (host:port) with these settings, on a connection
        of its own: channels of one process would otherwise share one, and a router
        tier's processes each take whole connections (SO_REUSEPORT)."""
        options: list[tuple[str, Any]] = [("grpc.use_local_subchannel_pool", 1)]
        if not self.uses_tls:
            return grpc.aio.insecure_channel(target, options=options)

        def read(path: str | None) -> bytes | None:
            return Path(path).read_bytes() if path else None

        credentials = grpc.ssl_channel_credentials(
            root_certificates=read(self.tls_ca),
            private_key=read(self.tls_key),
            certificate_chain=read(self.tls_cert),
        )
        if self.tls_server_name:
            options.append(("grpc.ssl_target_name_override", self.tls_server_name))
        return grpc.aio.secure_channel(target, credentials, options=options)

    def metadata(
        self, extra: Sequence[tuple[str, str]] | None = None
    ) -> tuple[tuple[str, str], ...] | None:
        """Call metadata: `extra` plus the bearer token, if any."""
        items = tuple(extra or ())
        if self.token:
            items += (("authorization", f"Bearer {self.token}"),)
        return items or None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ClientSecurity:
        """From the options of `add_security_arguments`."""
        token = None
        if args.auth_token_file:
            token = Path(args.auth_token_file).read_text().strip().splitlines()[0].strip()
        return cls(
            tls=args.tls,
            tls_ca=args.tls_ca,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            tls_server_name=args.tls_server_name,
            token=token,
        )


def add_security_arguments(parser: argparse.ArgumentParser) -> None:
    """Client-side TLS and token options (`pdserve generate`, `bench.load`)."""
    g = parser.add_argument_group("security")
    g.add_argument("--tls", action="store_true", help="TLS, trusting the system's roots")
    g.add_argument("--tls-ca", help="PEM CA bundle that signed the server certificate")
    g.add_argument("--tls-cert", help="PEM client certificate (server requires mTLS)")
    g.add_argument("--tls-key", help="PEM private key of --tls-cert")
    g.add_argument("--tls-server-name", help="expected name in the server certificate")
    g.add_argument("--auth-token-file", help="file whose first line is the bearer token")


def build_request(
    *,
    prompt: str | None = None,
    prompt_token_ids: Sequence[int] | None = None,
    messages: Iterable[Message] | None = None,
    request_id: str = "",
    priority: int = 0,
    include_trace_id: bool = False,
    resume_from_tokens: int | None = None,
    **sampling: Any,
) -> pb.GenerateRequest:
    """A GenerateRequest from Python values; sampling kwargs left at None stay unset."""
    unknown = set(sampling) - set(_SAMPLING_FIELDS)
    if unknown:
        raise TypeError(f"unknown sampling parameters: {sorted(unknown)}")
    request = pb.GenerateRequest(
        request_id=request_id, priority=priority, include_trace_id=include_trace_id
    )
    if resume_from_tokens is not None:
        request.resume_from_tokens = resume_from_tokens
    # Leave the oneof unset unless a value was given, so the server's "no input"
    # check is reachable from tests.
    if prompt is not None:
        request.prompt = prompt
    if prompt_token_ids is not None:
        request.prompt_token_ids.SetInParent()
        request.prompt_token_ids.token_ids.extend(prompt_token_ids)
    if messages is not None:
        request.messages.SetInParent()
        for m in messages:
            role, content = (m["role"], m["content"]) if isinstance(m, dict) else m
            request.messages.messages.add(role=role, content=content)
    fields = {k: v for k, v in sampling.items() if v is not None}
    request.sampling.CopyFrom(pb.SamplingParams(**fields))
    return request


async def stream_generate(
    target: str | grpc.aio.Channel,
    *,
    prompt: str | None = None,
    prompt_token_ids: Sequence[int] | None = None,
    messages: Iterable[Message] | None = None,
    request_id: str = "",
    priority: int = 0,
    timeout: float | None = None,
    metadata: Sequence[tuple[str, str]] | None = None,
    security: ClientSecurity | None = None,
    include_trace_id: bool = False,
    resume_from_tokens: int | None = None,
    **sampling: Any,
) -> AsyncIterator[pb.GenerateResponse]:
    """Yield every GenerateResponse of one call; raises grpc.aio.AioRpcError on failure.

    `target` is "host:port" (a channel is opened and closed here) or an open
    channel to reuse across calls. `security` adds TLS (to a channel opened here)
    and the bearer token. A W3C `traceparent` in `metadata` makes the server's trace a
    child of the caller's; `include_trace_id` asks for the trace id in the final message.
    """
    security = security or ClientSecurity()
    metadata = security.metadata(metadata)
    request = build_request(
        prompt=prompt,
        prompt_token_ids=prompt_token_ids,
        messages=messages,
        request_id=request_id,
        priority=priority,
        include_trace_id=include_trace_id,
        resume_from_tokens=resume_from_tokens,
        **sampling,
    )
    if isinstance(target, str):
        async with security.channel(target) as channel:
            async for response in _stream(channel, request, timeout, metadata):
                yield response
    else:
        async for response in _stream(target, request, timeout, metadata):
            yield response


# A broken stream worth resuming: the connection, or the router process behind it, went
# away (or the one reached was draining); each retry opens a new connection.
RESUMABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE})
RESUME_BACKOFF_S = (0.1, 0.3, 0.6, 1.0, 2.0, 4.0)


async def resumable_generate(
    target: str,
    *,
    request_id: str = "",
    on_resume: Callable[[int, grpc.aio.AioRpcError], None] | None = None,
    **kwargs: Any,
) -> AsyncIterator[pb.GenerateResponse]:
    """`stream_generate` that picks a broken stream up where it broke: on UNAVAILABLE
    (a reset connection, a router process gone) it calls again with the same request id
    and the number of tokens received (`resume_from_tokens`), and the stream goes on
    from the next token, on whichever router process takes the new connection. Up to
    `len(RESUME_BACKOFF_S)` times, waiting that long before each; then the error is
    raised. Every call carries `resume_from_tokens` (0 on the first), which also asks
    the server to keep the request decoding for a while should the stream break. The
    request id (unique among requests in flight) is made up here when none is given.
    `on_resume(tokens_received, error)` is told of each retry."""
    request_id = request_id or uuid.uuid4().hex
    received = 0
    for backoff_s in (*RESUME_BACKOFF_S, None):
        try:
            # 0 on the first call too: the server then keeps the request for a while
            # should this stream break, for the next call to take over.
            async for response in stream_generate(
                target, request_id=request_id, resume_from_tokens=received, **kwargs
            ):
                received += len(response.token_ids)
                yield response
            return
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in RESUMABLE_CODES or backoff_s is None:
                raise
            if on_resume is not None:
                on_resume(received, exc)
            await asyncio.sleep(backoff_s)


async def _stream(
    channel: grpc.aio.Channel,
    request: pb.GenerateRequest,
    timeout: float | None,
    metadata: Sequence[tuple[str, str]] | None,
) -> AsyncIterator[pb.GenerateResponse]:
    call = pb_grpc.GenerationServiceStub(channel).Generate(
        request, timeout=timeout, metadata=metadata
    )
    try:
        async for response in call:
            yield response
    finally:
        # A consumer that stops early cancels the RPC, so the server frees the request.
        call.cancel()


async def _call_once(
    target: str, method: str, request: Any, timeout: float, security: ClientSecurity | None
) -> Any:
    """One unary GenerationService call on a channel of its own."""
    security = security or ClientSecurity()
    async with security.channel(target) as channel:
        rpc = getattr(pb_grpc.GenerationServiceStub(channel), method)
        return await rpc(request, timeout=timeout, metadata=security.metadata())


async def get_server_info(
    target: str, timeout: float = 10.0, security: ClientSecurity | None = None
) -> pb.GetServerInfoResponse:
    """Call GetServerInfo once."""
    info: pb.GetServerInfoResponse = await _call_once(
        target, "GetServerInfo", pb.GetServerInfoRequest(), timeout, security
    )
    return info


async def get_pool_stats(
    target: str, timeout: float = 10.0, security: ClientSecurity | None = None
) -> pb.GetPoolStatsResponse:
    """Call GetPoolStats once (e.g. to check that blocks in use returned to 0)."""
    stats: pb.GetPoolStatsResponse = await _call_once(
        target, "GetPoolStats", pb.GetPoolStatsRequest(), timeout, security
    )
    return stats


def parse_target(value: str) -> str:
    """argparse type of --server/--target: HOST:PORT or [IPv6]:PORT, port required."""
    host, sep, port = value.rpartition(":")
    if value.startswith("unix:"):
        return value
    bracketed = host.startswith("[") and host.endswith("]")
    if not sep or not host or (":" in host and not bracketed) or not port.isdigit():
        raise argparse.ArgumentTypeError(
            f"expected HOST:PORT (e.g. {DEFAULT_TARGET}), got {value!r}"
        )
    if not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"port must be 1-65535, got {port}")
    return value


# One set of defaults, offline and against a server: the CLI sends them explicitly.
DEFAULT_MAX_TOKENS = 256


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `pdserve generate`."""
    parser.add_argument("prompt", help="text prompt")
    # No default: `pdserve generate` without --server generates offline in-process.
    parser.add_argument(
        "--server",
        type=parse_target,
        help=f"router HOST:PORT, e.g. {DEFAULT_TARGET} (default: generate offline, in-process)",
    )
    parser.add_argument(
        "--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="tokens to generate at most"
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (1 = off)")
    parser.add_argument("--top-k", type=int, default=0, help="top-k sampling (0 = off)")
    parser.add_argument("--seed", type=int, help="sampling seed (default: random)")
    parser.add_argument("--stop", action="append", help="stop string, repeatable (default: none)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-text")
    parser.add_argument("--chat", action="store_true", help="send the prompt as one user turn")
    parser.add_argument(
        "--request-id", default="", help="with --server: id to quote (default: assigned)"
    )
    parser.add_argument(
        "--timeout", type=float, help="with --server: deadline in seconds (default: none)"
    )
    add_security_arguments(parser)


def format_usage(final: pb.GenerateResponse, elapsed_s: float) -> str:
    """One line: finish reason, token counts, TTFT and wall time."""
    u, t = final.usage, final.timings
    reason = pb.FinishReason.Name(final.finish_reason).removeprefix("FINISH_REASON_").lower()
    return f"[{final.request_id}] " + usage_line(
        reason,
        prompt_tokens=u.prompt_tokens,
        completion_tokens=u.completion_tokens,
        cached_tokens=u.cached_prompt_tokens,
        ttft_s=t.time_to_first_token_seconds,
        total_s=elapsed_s,
    )


def usage_line(
    reason: str,
    *,
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int,
    ttft_s: float,
    total_s: float,
) -> str:
    """A finished request's counts and times, as `pdserve generate` prints them whether it
    ran the engine itself or streamed from a server."""
    return (
        f"finish={reason} prompt={prompt_tokens} completion={completion_tokens} "
        f"cached={cached_tokens} ttft={ttft_s:.3f}s total={total_s:.3f}s"
    )
