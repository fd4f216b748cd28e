"""`pdserve`'s flags: their definitions, the parser, and the configs they become.

Router flags become a `RouterConfig` in one place, `router_config` (beside
`add_router_args`); model and engine flags an `EngineArgs` in `engine_args`. Values
are checked by their types (`router.flag_types`) and across flags by
`router.flag_checks`, all before a model loads or Ray starts.
"""

from __future__ import annotations

import argparse

from engine.core.config import SchedulerConfig
from engine.factory import DEFAULT_KV_STREAM_MIN_TOKENS, EngineArgs
from engine.wire import POOLS  # noqa: F401 - the pools, named once
from router.config import DEFAULT_LOCAL_PREFILL_MAX_TOKENS, RouterConfig
from router.flag_types import (
    LOG_LEVELS,
    HelpFormatter,
    SubcommandParser,
    at_least,
    device,
    host_port,
    number_in,
    port,
    resources,
    speculative_config,
)
from router.planner.flags import add_planner_args
from router.prefill_policy import DEFAULT_SLO_TPOT_MS, DEFAULT_SLO_TTFT_MS
from router.routing import ROUTING_POLICIES, RoutingConfig
from router.security import DEFAULT_MAX_MESSAGE_BYTES

DEFAULT_METRICS_PORT = 9400  # router.metrics.DEFAULT_METRICS_PORT (not imported: keeps --help fast)
DESCRIPTION = "serve (the disaggregated service) and generate (offline, or against a server)."


# ---------------------------------------------------------------- flag groups
def add_model_args(p: argparse.ArgumentParser) -> list[argparse.Action]:
    """Which model, on which device, and how it runs."""
    g = p.add_argument_group("model")
    return [
        g.add_argument(
            "--model",
            help="local Hugging Face model folder (default: the embedded SmolLM2-135M-Instruct)",
        ),
        g.add_argument(
            "--dtype",
            choices=["float32", "bfloat16", "float16"],
            help="weights and KV cache (default: float32 on CPU, bfloat16 on CUDA)",
        ),
        g.add_argument("--device", type=device, default="auto", help="auto, cpu, cuda or cuda:N"),
        g.add_argument(
            "--load-format",
            choices=["auto", "dummy"],
            default="auto",
            help="dummy: random weights from config.json",
        ),
        g.add_argument(
            "--enforce-eager",
            action="store_true",
            help="no CUDA graphs for decode steps (CUDA only)",
        ),
        g.add_argument(
            "--no-compile",
            dest="compile_model",
            action="store_false",
            help="CUDA: run the decoder as transformers runs it, not torch.compile'd",
        ),
        g.add_argument(
            "--no-async-scheduling",
            dest="async_scheduling",
            action="store_false",
            help="CUDA: schedule each step only after the one before has finished "
            "(by default decode and colocated engines run one step ahead)",
        ),
        g.add_argument("--block-size", type=at_least(1), default=16, help="tokens per KV block"),
        g.add_argument(
            "--speculative-config",
            type=speculative_config,
            metavar="JSON",
            help="speculative decoding in decode and colocated engines (and offline), as "
            'vLLM spells it: {"method": "ngram", "num_speculative_tokens": 4, '
            '"prompt_lookup_max": 4, "prompt_lookup_min": 2} or {"method": "draft_model", '
            '"model": PATH, "num_speculative_tokens": 4}, optionally with '
            '"disable_by_batch_size": N (no speculation in steps of more than N requests) '
            "(default: off)",
        ),
    ]


def add_engine_args(p: argparse.ArgumentParser, prefix: str = "") -> list[argparse.Action]:
    """The scheduler and KV cache knobs of one engine (`--prefill-*`, `--decode-*`, or bare)."""
    dash = f"{prefix}-" if prefix else ""
    g = p.add_argument_group(f"{prefix} pool" if prefix else "engine")
    d = SchedulerConfig()
    return [
        g.add_argument(
            f"--{dash}max-num-seqs",
            type=at_least(1),
            default=d.max_num_seqs,
            help="requests running at once",
        ),
        g.add_argument(
            f"--{dash}max-num-batched-tokens",
            type=at_least(1),
            default=d.max_num_batched_tokens,
            help="tokens per step (prompt chunks + decodes); default 8192 on GPUs, 2048 on CPU",
        ),
        g.add_argument(
            f"--{dash}long-prefill-token-threshold",
            type=at_least(0),
            default=d.long_prefill_token_threshold,
            help="chunk prompts to at most this many tokens per step (0 = off)",
        ),
        g.add_argument(
            f"--{dash}enable-prefix-caching",
            action=argparse.BooleanOptionalAction,
            default=d.enable_prefix_caching,
            help="reuse the KV blocks of shared prompt prefixes",
        ),
        g.add_argument(
            f"--{dash}policy",
            choices=["fcfs", "priority"],
            default=d.policy,
            help="scheduling order; priority: lower value first, and a more urgent waiting "
            "request preempts the least urgent running one",
        ),
        g.add_argument(
            f"--{dash}priority-aging-s",
            type=number_in(0),
            default=d.priority_aging_s,
            help="priority policy: a waiting request gains one level per this many seconds "
            "(0 = no aging)",
        ),
        g.add_argument(
            f"--{dash}prioritize-prefill",
            action="store_true",
            help="schedule new prompts before running decodes",
        ),
        g.add_argument(
            f"--{dash}num-blocks",
            type=at_least(1),
            help="KV blocks (default: sized from kv-cache-gib or gpu-memory-utilization)",
        ),
        g.add_argument(
            f"--{dash}kv-cache-gib",
            type=number_in(0, open_low=True),
            help="KV cache size on CPU (default: 1)",
        ),
        g.add_argument(
            f"--{dash}gpu-memory-utilization",
            type=number_in(0, 1, open_low=True),
            default=0.85,
            help="CUDA: share of GPU memory for weights and KV cache",
        ),
    ]


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


def engine_args(ns: argparse.Namespace, prefix: str = "") -> EngineArgs:
    """One engine's arguments from the model flags and the (prefixed) engine flags."""
    pre = f"{prefix}_" if prefix else ""

    def get(name: str) -> object:
        return getattr(ns, pre + name)

    return EngineArgs(
        model=ns.model,
        dtype=ns.dtype,
        device=ns.device,
        load_format=ns.load_format,
        block_size=ns.block_size,
        enforce_eager=ns.enforce_eager,
        compile_model=ns.compile_model,
        # True: the engine's own default (one step ahead where it pays), not a forced on.
        async_scheduling=None if ns.async_scheduling else False,
        # The prefill pool stops at the first token: nothing to speculate.
        speculative=None if prefix == "prefill" else ns.speculative_config,
        num_blocks=get("num_blocks"),  # type: ignore[arg-type]
        kv_cache_gib=get("kv_cache_gib"),  # type: ignore[arg-type]
        gpu_memory_utilization=get("gpu_memory_utilization"),  # type: ignore[arg-type]
        scheduler=SchedulerConfig(
            max_num_seqs=get("max_num_seqs"),  # type: ignore[arg-type]
            max_num_batched_tokens=get("max_num_batched_tokens"),  # type: ignore[arg-type]
            long_prefill_token_threshold=get("long_prefill_token_threshold"),  # type: ignore[arg-type]
            enable_prefix_caching=get("enable_prefix_caching"),  # type: ignore[arg-type]
            policy=get("policy"),  # type: ignore[arg-type]
            prioritize_prefill=get("prioritize_prefill"),  # type: ignore[arg-type]
            priority_aging_s=get("priority_aging_s"),  # type: ignore[arg-type]
        ),
    )


def pool_resources(ns: argparse.Namespace) -> dict[str, dict[str, float]]:
    """The Ray resources each pool's workers require (only pools that were given some)."""
    return {
        pool: getattr(ns, f"{pool}_resources") for pool in POOLS if getattr(ns, f"{pool}_resources")
    }


# ---------------------------------------------------------------- the parser
def build_parser() -> argparse.ArgumentParser:
    """`pdserve` and its subcommands: serve, generate, scale, workers."""
    from router.admin_client import add_admin_arguments
    from router.client import add_generate_arguments

    parser = argparse.ArgumentParser(
        prog="pdserve", description=DESCRIPTION, formatter_class=HelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, default="INFO")
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
        type=at_least(0),
        default=DEFAULT_KV_STREAM_MIN_TOKENS,
        help="prompts of at least this many tokens stream their KV to the decode worker "
        "layer by layer while the prefill pass runs; shorter ones send it in one message "
        "after the pass (0 = stream every hand-off)",
    )
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
    add_engine_args(serve, "prefill")
    add_engine_args(serve, "decode")


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
