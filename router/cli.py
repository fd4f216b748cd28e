"""`pdserve`: serve (the disaggregated service) and generate (offline, or against a server)."""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import logging
import os
import socket
import sys
from collections.abc import Sequence

from engine.core.config import SchedulerConfig
from engine.factory import EngineArgs
from engine.sampling_params import SamplingParams
from router.config import DEFAULT_LOCAL_PREFILL_MAX_TOKENS, RouterConfig, keep_ray_on_loopback
from router.routing import ROUTING_POLICIES, RoutingConfig
from router.security import DEFAULT_MAX_MESSAGE_BYTES, EdgeSecurity

DEFAULT_METRICS_PORT = 9400  # router.metrics.DEFAULT_METRICS_PORT (not imported: keeps --help fast)


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help already states it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or action.default is argparse.SUPPRESS:
            return text
        if "default" in text:
            return text
        if action.default is False:
            return f"{text} (default: off)"
        return f"{text} (default: %(default)s)"


def _device(value: str) -> str:
    """argparse type of --device: auto, cpu, cuda or cuda:N."""
    head, _, index = value.partition(":")
    if value in ("auto", "cpu", "cuda") or (head == "cuda" and index.isdigit()):
        return value
    raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N, got {value!r}")


def _add_model_args(p: argparse.ArgumentParser) -> list[argparse.Action]:
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
        g.add_argument("--device", type=_device, default="auto", help="auto, cpu, cuda or cuda:N"),
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
        g.add_argument("--block-size", type=int, default=16, help="tokens per KV block"),
    ]


def _add_engine_args(p: argparse.ArgumentParser, prefix: str = "") -> list[argparse.Action]:
    dash = f"{prefix}-" if prefix else ""
    g = p.add_argument_group(f"{prefix or 'engine'} pool" if prefix else "engine")
    d = SchedulerConfig()
    return [
        g.add_argument(
            f"--{dash}max-num-seqs",
            type=int,
            default=d.max_num_seqs,
            help="requests running at once",
        ),
        g.add_argument(
            f"--{dash}max-num-batched-tokens",
            type=int,
            default=d.max_num_batched_tokens,
            help="tokens per step (prompt chunks + decodes); default 8192 on GPUs, 2048 on CPU",
        ),
        g.add_argument(
            f"--{dash}long-prefill-token-threshold",
            type=int,
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
            type=float,
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
            type=int,
            help="KV blocks (default: sized from kv-cache-gib or gpu-memory-utilization)",
        ),
        g.add_argument(
            f"--{dash}kv-cache-gib", type=float, help="KV cache size on CPU (default: 1)"
        ),
        g.add_argument(
            f"--{dash}gpu-memory-utilization",
            type=float,
            default=0.85,
            help="CUDA: share of GPU memory for weights and KV cache",
        ),
    ]


def _offline_only_flags() -> set[str]:
    """Options of `generate` that configure the in-process engine: no meaning with --server."""
    p = argparse.ArgumentParser(add_help=False)
    actions = _add_model_args(p) + _add_engine_args(p)
    return {opt for action in actions for opt in action.option_strings}


def _given_flags(argv: Sequence[str]) -> set[str]:
    """The options written on the command line (abbreviations are off, so names are exact)."""
    flags = set()
    for token in argv:
        if token == "--":
            break
        if token.startswith("--"):
            flags.add(token.split("=", 1)[0])
    return flags


def start_fresh_local_ray() -> None:
    """Make `ray.init()` start a new local instance, whatever earlier runs left behind.

    Without an address Ray joins the cluster named in its ray_current_cluster file,
    which a `ray start` that was not stopped cleanly leaves pointing at a dead head.
    pdserve joins a cluster only when asked (--ray-address).
    """
    os.environ["RAY_ADDRESS"] = "local"


def _port_problem(host: str, port: int) -> str | None:
    """Why the router could not listen on host:port, checked before Ray starts (fail fast)."""
    if port == 0:
        return None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as sock:
        # As grpc does: a port held only by TIME_WAIT connections of a past run is free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            if exc.errno == errno.EADDRINUSE:
                return f"{where} is in use"
            return f"cannot listen on {where}: {exc.strerror or exc}"
    return None


def _resources(text: str) -> dict[str, float]:
    """A JSON object of Ray resource amounts, e.g. '{\"prefill_node\": 1}'."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, int | float) and v >= 0 for k, v in value.items()
    ):
        raise argparse.ArgumentTypeError('expected an object of amounts, e.g. {"prefill_node": 1}')
    return {k: float(v) for k, v in value.items()}


def _add_deploy_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("placement (Ray resources each worker of a pool requires)")
    for pool in ("prefill", "decode", "colocated"):
        g.add_argument(
            f"--{pool}-resources",
            type=_resources,
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
        type=int,
        default=DEFAULT_MAX_MESSAGE_BYTES,
        help="largest request or response message",
    )
    g = p.add_argument_group("metrics")
    g.add_argument("--metrics-host", default="127.0.0.1", help="address of /metrics")
    g.add_argument(
        "--metrics-port",
        type=int,
        default=DEFAULT_METRICS_PORT,
        help="Prometheus /metrics port (0 = off)",
    )


def _engine_args(ns: argparse.Namespace, prefix: str = "") -> EngineArgs:
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


def _serve(ns: argparse.Namespace) -> int:
    if not ns.ray_address:
        keep_ray_on_loopback()  # before Ray is imported below
        start_fresh_local_ray()
    from router.cluster import Cluster, ClusterConfig
    from router.service import ServeConfig, run_service

    try:
        security = EdgeSecurity(
            tls_cert=ns.tls_cert,
            tls_key=ns.tls_key,
            tls_client_ca=ns.tls_client_ca,
            auth_token_file=ns.auth_token_file,
            max_message_bytes=ns.max_message_bytes,
        )
    except ValueError as exc:
        print(f"pdserve: {exc}", file=sys.stderr)
        return 2
    pool_resources = {
        pool: getattr(ns, f"{pool}_resources")
        for pool in ("prefill", "decode", "colocated")
        if getattr(ns, f"{pool}_resources")
    }
    config = ServeConfig(
        cluster=ClusterConfig(
            num_prefill_workers=ns.prefill_workers,
            num_decode_workers=ns.decode_workers,
            num_colocated_workers=ns.colocated_workers,
            prefill_args=_engine_args(ns, "prefill"),
            decode_args=_engine_args(ns, "decode"),
            ray_address=ns.ray_address,
            pool_resources=pool_resources,
            kv_store_port=ns.kv_store_port,
        ),
        router=RouterConfig(
            max_in_flight=ns.max_in_flight,
            max_queue=ns.max_queue,
            routing=RoutingConfig(policy=ns.routing),
            local_prefill_max_tokens=ns.local_prefill_max_tokens,
            # The router's queue follows the pools' policy: priority first, with aging.
            admission_order="priority"
            if "priority" in (ns.prefill_policy, ns.decode_policy)
            else "fifo",
            priority_aging_s=min(ns.prefill_priority_aging_s, ns.decode_priority_aging_s),
        ),
        host=ns.host,
        port=ns.port,
        drain_grace_s=ns.drain_grace_s,
        security=security,
        metrics_host=ns.metrics_host,
        metrics_port=ns.metrics_port,
        enable_admin=ns.enable_admin,
    )
    if ns.model is not None:
        config.cluster.decode_args.resolve_model_path()  # ValueError naming --model
    problem = _port_problem(ns.host, ns.port)
    if problem is not None:
        print(f"pdserve: startup failed: {problem}", file=sys.stderr)
        return 1
    cluster = Cluster(config.cluster)
    try:
        cluster.init_ray()
        asyncio.run(run_service(config, cluster))
    except Exception as exc:  # noqa: BLE001 - one line for the user; the traceback at DEBUG
        logging.getLogger("pdserve").debug("startup failed", exc_info=exc)
        print(f"pdserve: startup failed: {_one_line(exc, ns.ray_address)}", file=sys.stderr)
        return 1
    finally:
        cluster.shutdown_ray()
    return 0


def _one_line(exc: BaseException, ray_address: str | None) -> str:
    """A start-up failure as one line a user can act on."""
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


def _sampling_params(ns: argparse.Namespace) -> SamplingParams:
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


def _check_offline_args(ns: argparse.Namespace) -> EngineArgs:
    """Validate everything before the model loads; raises ValueError naming the flag."""
    args = _engine_args(ns)
    if args.model is not None:
        args.resolve_model_path()
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"--device {args.device}: no CUDA device is visible")
    return args


def _generate_offline(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        params = _sampling_params(ns)
        args = _check_offline_args(ns)
    except ValueError as exc:
        parser.error(str(exc))
    from engine.llm import LLM

    llm = LLM(args)
    prompt: str | list[int] = ns.prompt
    if ns.chat:
        from engine.frontend.prompt import encode_prompt

        prompt = encode_prompt(llm.tokenizer, messages=[("user", ns.prompt)])
    final = None
    for event in llm.stream([prompt], params):
        if event.chunk is not None:
            sys.stdout.write(event.chunk.text)
            sys.stdout.flush()
        final = event.finish_reason or final
    sys.stdout.write("\n")
    print(f"finish={final.value if final else '?'}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from router.client import add_generate_arguments

    parser = argparse.ArgumentParser(
        prog="pdserve", description=__doc__, formatter_class=HelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, default="INFO")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=SubcommandParser)

    serve = sub.add_parser("serve", help="run the disaggregated gRPC service")
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)"
    )
    serve.add_argument("--port", type=int, default=50051, help="gRPC port")
    serve.add_argument("--prefill-workers", type=int, default=1, help="prefill pool size")
    serve.add_argument("--decode-workers", type=int, default=1, help="decode pool size")
    serve.add_argument(
        "--colocated-workers",
        type=int,
        default=0,
        help="N > 0: N replicas that run both phases (with the --decode-* knobs), no pools",
    )
    serve.add_argument("--ray-address", help="join this Ray cluster (default: start a local one)")
    serve.add_argument(
        "--max-in-flight",
        type=int,
        default=RouterConfig.max_in_flight,
        help="requests running at once",
    )
    serve.add_argument(
        "--max-queue",
        type=int,
        default=RouterConfig.max_queue,
        help="requests waiting; beyond it RESOURCE_EXHAUSTED",
    )
    serve.add_argument(
        "--drain-grace-s",
        type=float,
        default=30.0,
        help="SIGTERM: seconds in-flight requests get before they end with ABORT",
    )
    serve.add_argument(
        "--routing",
        choices=ROUTING_POLICIES,
        default="prefix-aware",
        help="which worker runs a prompt: the one whose prefix cache holds most of it, "
        "minus a load penalty (prefix-aware), or the least loaded",
    )
    serve.add_argument(
        "--local-prefill-max-tokens",
        type=int,
        default=DEFAULT_LOCAL_PREFILL_MAX_TOKENS,
        help="prompts with at most this many tokens not cached on the decode worker run "
        "there, with no hand-off (0 = always hand off)",
    )
    serve.add_argument(
        "--kv-store-port",
        type=int,
        default=0,
        help="port on the router's host where the KV channels rendezvous (0 = any free one)",
    )
    serve.add_argument(
        "--enable-admin",
        action="store_true",
        help="serve AdminService (pdserve scale / workers); refused with PERMISSION_DENIED "
        "when off",
    )
    _add_deploy_args(serve)
    _add_model_args(serve)
    _add_engine_args(serve, "prefill")
    _add_engine_args(serve, "decode")

    gen = sub.add_parser(
        "generate",
        help="generate for one prompt: offline in this process, or from a server with --server",
    )
    add_generate_arguments(gen)

    from router.admin_client import add_admin_arguments

    scale = sub.add_parser(
        "scale", help="resize pools or drain a worker of a running server (needs --enable-admin)"
    )
    workers = sub.add_parser("workers", help="list the workers of a running server")
    add_admin_arguments(scale, workers)
    _add_model_args(gen)
    _add_engine_args(gen)
    return parser


class SubcommandParser(argparse.ArgumentParser):
    """A subcommand: defaults in its help, exact option names, and its own --log-level."""

    def __init__(self, **kwargs: object) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(**kwargs)  # type: ignore[arg-type]
        # SUPPRESS: given after the subcommand it overrides the top-level one, else not.
        self.add_argument(
            "--log-level",
            type=str.upper,
            choices=LOG_LEVELS,
            default=argparse.SUPPRESS,
            help="log verbosity (default: INFO)",
        )


def _subcommand_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    for action in parser._actions:  # argparse keeps no public handle on its subparsers
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[command]  # type: ignore[no-any-return]
    return parser


def _check_generate_flags(
    ns: argparse.Namespace, parser: argparse.ArgumentParser, argv: Sequence[str]
) -> None:
    """Refuse flags that do not apply: engine flags with --server, client flags offline."""
    given = _given_flags(argv)
    if ns.server:
        wrong = sorted(given & _offline_only_flags())
        if wrong:
            parser.error(
                f"{', '.join(wrong)}: only for offline generation (without --server); "
                "a server's model and engine are set by `pdserve serve`"
            )
        return
    client_only = {"--timeout", "--request-id"} | _security_flags()
    wrong = sorted(given & client_only)
    if wrong:
        parser.error(f"{', '.join(wrong)}: only with --server (offline generation is in-process)")


def _security_flags() -> set[str]:
    """The client's TLS and token options (they only mean something with --server)."""
    from router.client import add_security_arguments

    probe = argparse.ArgumentParser(add_help=False)
    add_security_arguments(probe)
    return {opt for action in probe._actions for opt in action.option_strings}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `pdserve` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # parse_known_args: an unknown flag is reported with its subcommand's usage.
    ns, unknown = parser.parse_known_args(argv)
    sub = _subcommand_parser(parser, ns.command)
    if unknown:
        sub.error(f"unrecognized arguments: {' '.join(unknown)}")
    logging.basicConfig(
        level=ns.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        if ns.command == "serve":
            try:
                return _serve(ns)
            except ValueError as exc:  # a flag value the configs refuse, found before Ray
                sub.error(str(exc))
        if ns.command in ("scale", "workers"):
            from router.admin_client import run_admin

            return asyncio.run(run_admin(ns))
        if ns.command == "generate":
            _check_generate_flags(ns, sub, argv)
            if ns.server:
                from router.client import run_generate

                return asyncio.run(run_generate(ns))
            return _generate_offline(ns, sub)
    except KeyboardInterrupt:
        # Ctrl-C: the user knows why it stopped; no traceback.
        print("\npdserve: interrupted", file=sys.stderr)
        return 130
    sub.error(f"unknown command {ns.command}")


if __name__ == "__main__":
    sys.exit(main())
