"""What `pdserve serve` and `pdserve generate` do once their flags are checked.

Each command comes in two steps: building its configuration, which raises ValueError
for a value the configs refuse (the caller turns that into a usage error, before
anything has started), then running, which reports its own failures in one line.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.args import EngineArgs
from engine.sampling_params import SamplingParams
from router.cli.engine_flags import engine_args
from router.cli.flags import pool_resources, router_config
from router.fleet import port_holds
from router.planner.flags import planner_config
from router.serving.config import keep_ray_on_loopback

if TYPE_CHECKING:
    from pdserve.v1 import generation_pb2
    from router.cli.client import ClientSecurity
    from router.config import ServeConfig
    from router.fleet.cluster import Cluster

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- serve
def prepare_local_ray() -> None:
    """Settings for the local Ray instance `serve` starts when given no --ray-address.

    Call before Ray is imported. Without an address Ray joins the cluster named in its
    ray_current_cluster file, which a `ray start` that was not stopped cleanly leaves
    pointing at a dead head: pdserve joins a cluster only when asked (--ray-address).
    The instance listens on loopback only, so, as under `make run`, it runs without
    Ray's token authentication (and Ray's warning about it) unless RAY_AUTH_MODE says
    otherwise.
    """
    keep_ray_on_loopback()
    os.environ["RAY_ADDRESS"] = "local"
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def quiet_worker_output() -> None:
    """Workers' lines reach this process's stderr with a Ray prefix, coloured by default:
    plain when stderr is a file or a pipe (a service's log), unless the user chose."""
    if not sys.stderr.isatty():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")


def serve_config(ns: argparse.Namespace) -> ServeConfig:
    """The service's configuration from checked flags; ValueError names a refused value."""
    from router.edge.security import EdgeSecurity

    security = EdgeSecurity(
        tls_cert=ns.tls_cert,
        tls_key=ns.tls_key,
        tls_client_ca=ns.tls_client_ca,
        auth_token_file=ns.auth_token_file,
        max_message_bytes=ns.max_message_bytes,
    )
    if not ns.ray_address:
        prepare_local_ray()  # before Ray is imported below
    quiet_worker_output()
    from engine.tracing import TracingConfig
    from router.config import ServeConfig
    from router.fleet.cluster_config import ClusterConfig

    return ServeConfig(
        cluster=ClusterConfig(
            num_prefill_workers=ns.prefill_workers,
            num_decode_workers=ns.decode_workers,
            num_colocated_workers=ns.colocated_workers,
            prefill_args=replace(
                engine_args(ns, "prefill"), kv_stream_min_tokens=ns.kv_stream_min_tokens
            ),
            decode_args=engine_args(ns, "decode"),
            ray_address=ns.ray_address,
            pool_resources=pool_resources(ns),
            kv_store_port=ns.kv_store_port,
            worker_calls=ns.worker_calls,
            placement_timeout_s=ns.placement_timeout_s,
            max_workers=ns.max_gpus if ns.planner else 0,
            tracing=TracingConfig(ns.otlp_traces_endpoint or "", ns.otlp_traces_sample_ratio),
        ),
        planner=planner_config(ns),
        router=router_config(ns),
        host=ns.host,
        port=ns.port,
        drain_grace_s=ns.drain_grace_s,
        security=security,
        metrics_host=ns.metrics_host,
        metrics_port=ns.metrics_port,
        enable_admin=ns.enable_admin,
        router_processes=ns.router_processes,
        resume_grace_s=ns.resume_grace_s,
    )


def serve(config: ServeConfig) -> int:
    """Listen, start Ray and the service, serve until stopped; returns the exit status."""
    import asyncio

    from router.service import RayLostError, run_service

    # The service's ports are bound now and kept through Ray's start, whose processes
    # would otherwise be free to take them (router/fleet/port_holds.py).
    ports = [(config.host, config.port), (config.metrics_host, config.metrics_port)]
    if config.metrics_port:  # a router tier's other processes: the next ones
        ports += [
            (config.metrics_host, config.metrics_port + i)
            for i in range(1, config.router_processes)
        ]
    for host, port in ports:
        problem = port_holds.hold(host, port)
        if problem is not None:
            port_holds.release_all()
            print(f"pdserve: startup failed: {problem}", file=sys.stderr)
            return 1
    ray_address = config.cluster.ray_address
    clusters: list[Cluster] = []  # the one run_service starts Ray in, once it exists
    status = 0
    try:
        asyncio.run(run_service(config, on_cluster=clusters.append))
    except RayLostError as exc:
        print(f"pdserve: {exc}", file=sys.stderr)
        status = 1
    except Exception as exc:  # noqa: BLE001 - one line for the user; the traceback at DEBUG
        log.debug("startup failed", exc_info=exc)
        print(f"pdserve: startup failed: {one_line(exc, ray_address)}", file=sys.stderr)
        status = 1
    finally:
        port_holds.release_all()
    if any(cluster.abandoned for cluster in clusters):
        # Ray's driver threads would still wait for the dead GCS and abort the process
        # at the end of their reconnect timeout: leave now, with the work done.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


def one_line(exc: BaseException, ray_address: str | None = None) -> str:
    """A failure as one line a user can act on."""
    text = f"{type(exc).__name__} {exc}"
    if ray_address and "auth" in text.lower():
        return (
            f"cannot join the Ray cluster at {ray_address}: it uses token authentication; "
            "set RAY_AUTH_MODE=token and the cluster's token (RAY_AUTH_TOKEN or "
            "~/.ray/auth_token), as on its nodes"
        )
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    more = " (--log-level DEBUG shows more)" if len(lines) > 1 else ""
    return lines[0] + more


# ---------------------------------------------------------------- generate
def sampling_params(ns: argparse.Namespace) -> SamplingParams:
    """The same defaults offline and against a server (the flags carry them)."""
    return SamplingParams(
        max_tokens=ns.max_tokens,
        temperature=ns.temperature,
        top_p=ns.top_p,
        top_k=ns.top_k,
        seed=ns.seed,
        stop=tuple(ns.stop or ()),
        ignore_eos=ns.ignore_eos,
    )


def offline_engine_args(ns: argparse.Namespace) -> EngineArgs:
    """The in-process engine's arguments, checked before the model loads (ValueError)."""
    args = engine_args(ns)
    if args.model is not None:
        args.resolve_model_path()
    return args


def generate_offline(args: EngineArgs, params: SamplingParams, ns: argparse.Namespace) -> int:
    """Load the model in this process and print one prompt's completion as it arrives."""
    from engine.llm import LLM

    try:
        llm = LLM(args)
    except Exception as exc:  # noqa: BLE001 - one line for the user; the traceback at DEBUG
        log.debug("loading the model failed", exc_info=exc)
        print(f"pdserve generate: cannot load the model: {one_line(exc)}", file=sys.stderr)
        return 1
    from engine.frontend.prompt import encode_prompt
    from router.cli.client import usage_line

    final = None
    completion_tokens = cached_tokens = 0
    start = time.perf_counter()
    ttft_s = 0.0
    try:
        # Encoded here, as the engine would, so the summary can give the prompt's size.
        if ns.chat:
            prompt = encode_prompt(llm.tokenizer, messages=[("user", ns.prompt)])
        else:
            prompt = encode_prompt(llm.tokenizer, prompt=ns.prompt)
        # The engine checks every prompt before it yields anything: a ValueError here is
        # the prompt's, as a server's INVALID_ARGUMENT would be.
        for event in llm.stream([prompt], params):
            if event.chunk is not None:
                if event.chunk.token_ids and not completion_tokens:
                    ttft_s = time.perf_counter() - start
                completion_tokens += len(event.chunk.token_ids)
                sys.stdout.write(event.chunk.text)
                sys.stdout.flush()
            if event.finish_reason is not None:
                final, cached_tokens = event.finish_reason, event.num_cached_tokens
    except ValueError as exc:
        print(f"pdserve generate: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write("\n")
    summary = usage_line(
        final.value if final else "?",
        prompt_tokens=len(prompt),
        completion_tokens=completion_tokens,
        cached_tokens=cached_tokens,
        ttft_s=ttft_s,
        total_s=time.perf_counter() - start,
    )
    print(summary, file=sys.stderr)
    return 0


def client_security(ns: argparse.Namespace) -> ClientSecurity:
    """TLS and token settings of a client command; ValueError names an unreadable file."""
    from router.cli.client import ClientSecurity

    for flag in ("tls_ca", "tls_cert", "tls_key", "auth_token_file"):
        path = getattr(ns, flag)
        if path and not Path(path).is_file():
            raise ValueError(f"--{flag.replace('_', '-')}: no such file: {path}")
    try:
        return ClientSecurity.from_args(ns)
    except (OSError, UnicodeDecodeError, IndexError) as exc:
        raise ValueError(f"--auth-token-file {ns.auth_token_file}: no token in it") from exc


async def generate_from_server(
    ns: argparse.Namespace, params: SamplingParams, security: ClientSecurity
) -> int:
    """Stream one prompt's completion from a server; 0 only when it ended by stop or length."""
    import grpc

    from pdserve.v1 import generation_pb2 as pb
    from router.cli.client import resumable_generate

    def resuming(received: int, exc: grpc.aio.AioRpcError) -> None:
        log.warning("stream broke (%s) after %d tokens; resuming", exc.code().name, received)

    inputs: dict[str, Any] = (
        {"messages": [("user", ns.prompt)]} if ns.chat else {"prompt": ns.prompt}
    )
    start = time.perf_counter()
    final: generation_pb2.GenerateResponse | None = None
    try:
        # A stream that breaks (its router process died) picks up where it was.
        async for response in resumable_generate(
            ns.server,
            **inputs,
            on_resume=resuming,
            request_id=ns.request_id,
            timeout=ns.timeout,
            security=security,
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            seed=ns.seed,
            stop=list(params.stop),
            ignore_eos=params.ignore_eos or None,
        ):
            sys.stdout.write(response.text)
            sys.stdout.flush()
            if response.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                final = response
    except grpc.aio.AioRpcError as exc:
        sys.stdout.write("\n")
        if final is None:  # an ERROR final comes before its INTERNAL status, and says more
            print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    else:
        sys.stdout.write("\n")
    if final is None:
        print("error: stream ended without a final message", file=sys.stderr)
        return 1
    print(format_final(final, time.perf_counter() - start), file=sys.stderr)
    completed = (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
    return 0 if final.finish_reason in completed else 1


def format_final(final: generation_pb2.GenerateResponse, elapsed_s: float) -> str:
    """One line: finish reason, token counts and times; for an abort or error, why."""
    from pdserve.v1 import generation_pb2 as pb
    from router.cli.client import format_usage

    if final.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH):
        return format_usage(final, elapsed_s)
    # The server knows no prompt size or first-token time for a request it gave up on.
    reason = pb.FinishReason.Name(final.finish_reason).removeprefix("FINISH_REASON_").lower()
    return (
        f"[{final.request_id}] finish={reason} completion={final.usage.completion_tokens} "
        f"total={elapsed_s:.3f}s error: {final.error or 'no reason given'}"
    )
