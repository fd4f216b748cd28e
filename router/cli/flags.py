"""`pdserve`'s parser: the subcommands, the router, serve and deployment flags, and the
configs they become.

Router flags become a `RouterConfig` in one place, `router_config` (beside
`add_router_args`). The model and engine flags, shared by serve's pools and offline
generate, are in `router.cli.engine_flags`; the planner's in `router.planner.flags`. Values
are checked by their types (`router.cli.flag_types`) and across flags by
`router.cli.flag_checks`, all before a model loads or Ray starts.
"""

from __future__ import annotations

import argparse

from engine.args import DEFAULT_KV_STREAM_MIN_TOKENS
from engine.wire import POOLS
from router.cli.engine_flags import add_engine_args, add_model_args, add_parallel_args
from router.cli.flag_types import (
    LOG_LEVELS,
    HelpFormatter,
    SubcommandParser,
    at_least,
    auto_or_at_least,
    host_port,
    number_in,
    port,
    resources,
    stream_interval,
)
from router.edge.security import DEFAULT_MAX_MESSAGE_BYTES
from router.planner.flags import add_planner_args
from router.routing.cache_aware import ROUTING_POLICIES, RoutingConfig
from router.routing.prefill_policy import DEFAULT_SLO_TPOT_MS, DEFAULT_SLO_TTFT_MS
from router.serving.config import DEFAULT_LOCAL_PREFILL_MAX_TOKENS, RouterConfig

DEFAULT_METRICS_PORT = (
    9400  # router.observability.metrics.DEFAULT_METRICS_PORT (not imported: keeps --help fast)
)
DESCRIPTION = (
    "serve (the disaggregated service), generate (offline, or against a server), and "
    "against a server started with --enable-admin: workers, scale and prefill-policy."
)


# ---------------------------------------------------------------- flag groups
def add_router_args(p: argparse.ArgumentParser) -> None:
    """Admission and routing: what `router_config` turns into a RouterConfig."""
    g = p.add_argument_group("router")
    g.add_argument(
        "--max-in-flight",
        type=at_least(1),
        default=RouterConfig.max_in_flight,
        help="requests running at once",
    )
    g.add_argument(
        "--max-queue",
        type=at_least(0),
        default=RouterConfig.max_queue,
        help="requests waiting; beyond it RESOURCE_EXHAUSTED",
    )
    g.add_argument(
        "--reservation-lease-s",
        type=number_in(0, open_low=True),
        default=RouterConfig.lease_s,
        help="a decode reservation whose request shows no progress for this long is "
        "freed (the router renews it while the request waits for or runs its prefill)",
    )
    g.add_argument(
        "--max-migrations",
        type=at_least(0),
        default=RouterConfig.max_migrations,
        help="times one request may move to another worker when its decode (or "
        "colocated) worker is lost after tokens were streamed; it goes on from the "
        "streamed tokens, with the same text. 0 = such a request ends with an error",
    )
    g.add_argument(
        "--stream-interval",
        type=stream_interval,
        default=RouterConfig.stream_interval,
        help="tokens each stream message waits for after the first (the final message "
        "flushes the rest): fewer, larger messages where many streams of a small model "
        "make the router the limit, for up to N - 1 decode steps of delay. 1 = every "
        "chunk at once; auto = 1 below 32 open streams, then one more per 16 streams "
        "(8 at 128), up to 16",
    )
    g.add_argument(
        "--decode-peer-channels",
        choices=("lazy", "eager"),
        default=RouterConfig.decode_peer_channels,
        help="KV channels between decode workers, for live migration on drain: made at "
        "the first drain (lazy) or as soon as a decode worker is live (eager: a drain "
        "then pays no channel set-up, at the cost of one channel per ordered pair)",
    )
    g.add_argument(
        "--routing",
        choices=ROUTING_POLICIES,
        default="prefix-aware",
        help="which worker runs a prompt: the one whose prefix cache holds most of it, "
        "minus a load penalty (prefix-aware), or the least loaded",
    )
    g.add_argument(
        "--local-prefill-max-tokens",
        type=at_least(0),
        default=DEFAULT_LOCAL_PREFILL_MAX_TOKENS,
        help="prompts with at most this many tokens not cached on the decode worker run "
        "there, with no hand-off; longer ones too when the prefill pool is saturated "
        "(see --slo-ttft-ms). 0 = always hand off",
    )
    g.add_argument(
        "--slo-ttft-ms",
        type=number_in(0, open_low=True),
        default=DEFAULT_SLO_TTFT_MS,
        help="time-to-first-token target: when the prefill pool cannot meet it, prompts "
        "run on the decode worker if it stays within --slo-tpot-ms",
    )
    g.add_argument(
        "--slo-tpot-ms",
        type=number_in(0, open_low=True),
        default=DEFAULT_SLO_TPOT_MS,
        help="time-per-output-token target that a prompt run on a decode worker must keep",
    )


def router_config(ns: argparse.Namespace) -> RouterConfig:
    """The router's settings from `add_router_args`' flags (and the pools' policies)."""
    return RouterConfig(
        max_in_flight=ns.max_in_flight,
        max_queue=ns.max_queue,
        lease_s=ns.reservation_lease_s,
        max_migrations=ns.max_migrations,
        decode_peer_channels=ns.decode_peer_channels,
        stream_interval=ns.stream_interval,
        routing=RoutingConfig(policy=ns.routing),
        local_prefill_max_tokens=ns.local_prefill_max_tokens,
        slo_ttft_ms=ns.slo_ttft_ms,
        slo_tpot_ms=ns.slo_tpot_ms,
        # The router's queue follows the pools' policy: priority first, with aging.
        admission_policy="priority"
        if "priority" in (ns.prefill_policy, ns.decode_policy)
        else "fcfs",
        priority_aging_s=min(ns.prefill_priority_aging_s, ns.decode_priority_aging_s),
    )


def pool_resources(ns: argparse.Namespace) -> dict[str, dict[str, float]]:
    """The Ray resources each pool's workers require (only pools that were given some)."""
    return {
        pool: getattr(ns, f"{pool}_resources") for pool in POOLS if getattr(ns, f"{pool}_resources")
    }


# ---------------------------------------------------------------- the parser
def build_parser() -> argparse.ArgumentParser:
    """`pdserve` and its subcommands: serve, generate, scale, workers."""
    from router.cli.admin_client import add_admin_arguments
    from router.cli.client import add_generate_arguments

    parser = argparse.ArgumentParser(
        prog="pdserve", description=DESCRIPTION, formatter_class=HelpFormatter, allow_abbrev=False
    )
    parser.add_argument(
        "--log-level", type=str.upper, choices=LOG_LEVELS, default="INFO", help="log verbosity"
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=SubcommandParser)

    serve = sub.add_parser("serve", help="run the disaggregated gRPC service")
    add_serve_args(serve)

    gen = sub.add_parser(
        "generate",
        help="generate for one prompt: offline in this process, or from a server with --server",
    )
    add_generate_arguments(gen)
    scale = sub.add_parser(
        "scale", help="resize pools or drain a worker of a running server (needs --enable-admin)"
    )
    workers = sub.add_parser("workers", help="list the workers of a running server")
    policy = sub.add_parser(
        "prefill-policy",
        help="show or change where a running server runs prompts (needs --enable-admin)",
    )
    add_admin_arguments(scale, workers, policy)
    add_model_args(gen)
    add_engine_args(gen)
    return parser


def add_serve_args(serve: argparse.ArgumentParser) -> None:
    """Every flag of `pdserve serve`."""
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)"
    )
    serve.add_argument("--port", type=port, default=50051, help="gRPC port (0 = any free one)")
    serve.add_argument("--prefill-workers", type=at_least(1), default=1, help="prefill pool size")
    serve.add_argument("--decode-workers", type=at_least(1), default=1, help="decode pool size")
    serve.add_argument(
        "--colocated-workers",
        type=at_least(0),
        default=0,
        help="N > 0: N replicas that run both phases (with the --decode-* knobs), no pools",
    )
    serve.add_argument("--ray-address", help="join this Ray cluster (default: start a local one)")
    serve.add_argument(
        "--drain-grace-s",
        type=number_in(0),
        default=30.0,
        help="SIGTERM: seconds in-flight requests get before they end with ABORT",
    )
    serve.add_argument(
        "--kv-store-port",
        type=port,
        default=0,
        help="port on the router's host where the KV channels rendezvous (0 = any free one)",
    )
    serve.add_argument(
        "--placement-timeout-s",
        type=number_in(0, open_low=True),
        default=60.0,
        help="how long a new worker may wait for a device (its placement group); raise it "
        "where a cluster autoscaler adds nodes on demand, which takes minutes",
    )
    serve.add_argument(
        "--kv-stream-min-tokens",
        type=auto_or_at_least(0),
        default=DEFAULT_KV_STREAM_MIN_TOKENS,
        help="prompts of at least this many tokens stream their KV to the decode worker "
        "layer by layer while the prefill pass runs; shorter ones send it in one message "
        "after the pass (0 = stream every hand-off; auto = the length whose KV reaches "
        "256 MiB: 2048 tokens of an 8B Llama, 8192 of a 1B)",
    )
    serve.add_argument(
        "--worker-calls",
        choices=("direct", "ray"),
        default="direct",
        help="how the router calls its workers once Ray has started them: over a TCP "
        "connection of each worker's own (direct; authenticated, loopback on the router's "
        "node) or as Ray actor calls (ray; about 2 ms a round trip)",
    )
    add_tier_args(serve)
    serve.add_argument(
        "--enable-admin",
        action="store_true",
        help="serve AdminService (pdserve scale / workers); refused with PERMISSION_DENIED "
        "when off",
    )
    add_router_args(serve)
    add_planner_args(serve)
    add_deploy_args(serve)
    add_model_args(serve)
    add_parallel_args(serve)
    add_engine_args(serve, "prefill")
    add_engine_args(serve, "decode")


def add_tier_args(serve: argparse.ArgumentParser) -> None:
    """The router tier's flags of `pdserve serve`."""
    serve.add_argument(
        "--router-processes",
        type=at_least(1),
        default=1,
        help="router processes serving the port, each with its own event loop (the "
        "first owns the workers; the others route over them, and the first starts any "
        "that exits again): raise it when the router's event loop is the limit or so "
        "that one process's failure is no outage. Process i serves /metrics on "
        "--metrics-port + i",
    )
    serve.add_argument(
        "--resume-grace-s",
        type=number_in(0),
        default=30.0,
        help="with --router-processes above 1: how long a decode worker keeps the "
        "requests of a router process that went away, for a client to resume their "
        "streams through another, before it aborts them",
    )


def add_deploy_args(p: argparse.ArgumentParser) -> None:
    """Placement, security and metrics flags of `pdserve serve`."""
    g = p.add_argument_group("placement (Ray resources each worker of a pool requires)")
    for pool in POOLS:
        g.add_argument(
            f"--{pool}-resources",
            type=resources,
            default={},
            metavar="JSON",
            help=f"e.g. '{{\"{pool}_node\": 1}}': {pool} workers go to nodes that offer it",
        )
    g = p.add_argument_group("security")
    g.add_argument("--tls-cert", help="PEM server certificate: serve gRPC over TLS")
    g.add_argument("--tls-key", help="PEM private key of --tls-cert")
    g.add_argument("--tls-client-ca", help="PEM CA bundle: require client certificates (mTLS)")
    g.add_argument(
        "--auth-token-file",
        help="bearer tokens, one per line; calls without one get UNAUTHENTICATED "
        "(health and reflection stay open)",
    )
    g.add_argument(
        "--max-message-bytes",
        type=at_least(1024),
        default=DEFAULT_MAX_MESSAGE_BYTES,
        help="largest request or response message",
    )
    g = p.add_argument_group("tracing (OpenTelemetry)")
    g.add_argument(
        "--otlp-traces-endpoint",
        type=host_port,
        metavar="HOST:PORT",
        help="send a trace of each request (router and workers) to this OTLP/gRPC "
        "collector (default: no tracing)",
    )
    g.add_argument(
        "--otlp-traces-sample-ratio",
        type=number_in(0, 1),
        default=1.0,
        help="share of requests traced, of those whose caller sent no sampled traceparent",
    )
    g = p.add_argument_group("metrics")
    g.add_argument("--metrics-host", default="127.0.0.1", help="address of /metrics")
    g.add_argument(
        "--metrics-port",
        type=port,
        default=DEFAULT_METRICS_PORT,
        help="Prometheus /metrics port (0 = off)",
    )
