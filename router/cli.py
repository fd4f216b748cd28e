"""`pdserve`: serve (the disaggregated service) and generate (offline, or against a server)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from collections.abc import Sequence

from engine.core.config import SchedulerConfig
from engine.factory import EngineArgs
from engine.sampling_params import SamplingParams
from router.config import RouterConfig, keep_ray_on_loopback
from router.security import DEFAULT_MAX_MESSAGE_BYTES, EdgeSecurity

DEFAULT_METRICS_PORT = 9400  # router.metrics.DEFAULT_METRICS_PORT (not imported: keeps --help fast)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument(
        "--model", help="local HF model folder (default: embedded SmolLM2-135M-Instruct)"
    )
    g.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--device", default="auto", help="auto, cpu, cuda")
    g.add_argument("--load-format", choices=["auto", "dummy"], default="auto")
    g.add_argument(
        "--enforce-eager", action="store_true", help="no CUDA graphs for decode steps (CUDA only)"
    )
    g.add_argument("--block-size", type=int, default=16)


def _add_engine_args(p: argparse.ArgumentParser, prefix: str = "") -> None:
    dash = f"{prefix}-" if prefix else ""
    g = p.add_argument_group(f"{prefix or 'engine'} pool" if prefix else "engine")
    d = SchedulerConfig()
    g.add_argument(f"--{dash}max-num-seqs", type=int, default=d.max_num_seqs)
    g.add_argument(f"--{dash}max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    g.add_argument(
        f"--{dash}long-prefill-token-threshold",
        type=int,
        default=d.long_prefill_token_threshold,
        help="chunk prompts to at most this many tokens per step (0 = off)",
    )
    g.add_argument(
        f"--{dash}enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=d.enable_prefix_caching,
    )
    g.add_argument(f"--{dash}policy", choices=["fcfs", "priority"], default=d.policy)
    g.add_argument(f"--{dash}prioritize-prefill", action="store_true")
    g.add_argument(f"--{dash}num-blocks", type=int, help="KV blocks (default: from memory)")
    g.add_argument(f"--{dash}kv-cache-gib", type=float, help="KV cache size (CPU default 1)")
    g.add_argument(f"--{dash}gpu-memory-utilization", type=float, default=0.85)


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
    g.add_argument("--metrics-host", default="127.0.0.1")
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
        ),
    )


def _serve(ns: argparse.Namespace) -> int:
    if not ns.ray_address:
        keep_ray_on_loopback()  # before Ray is imported below
    from router.cluster import Cluster, ClusterConfig, StartupError
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
        ),
        router=RouterConfig(max_in_flight=ns.max_in_flight, max_queue=ns.max_queue),
        host=ns.host,
        port=ns.port,
        drain_grace_s=ns.drain_grace_s,
        security=security,
        metrics_host=ns.metrics_host,
        metrics_port=ns.metrics_port,
    )
    cluster = Cluster(config.cluster)
    cluster.init_ray()
    try:
        asyncio.run(run_service(config, cluster))
    except StartupError as exc:
        print(f"pdserve: startup failed: {exc}", file=sys.stderr)
        return 1
    finally:
        cluster.shutdown_ray()
    return 0


def _generate_offline(ns: argparse.Namespace) -> int:
    from engine.llm import LLM

    llm = LLM(_engine_args(ns))
    params = SamplingParams(
        max_tokens=ns.max_tokens or 64,
        temperature=0.0 if ns.temperature is None else ns.temperature,
        top_p=1.0 if ns.top_p is None else ns.top_p,
        top_k=ns.top_k or 0,
        seed=ns.seed,
        stop=tuple(ns.stop or ()),
        ignore_eos=ns.ignore_eos,
    )
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

    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the disaggregated gRPC service")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=50051)
    serve.add_argument("--prefill-workers", type=int, default=1)
    serve.add_argument("--decode-workers", type=int, default=1)
    serve.add_argument(
        "--colocated-workers",
        type=int,
        default=0,
        help="N > 0: N replicas that run both phases (with the --decode-* knobs), no pools",
    )
    serve.add_argument("--ray-address", help="join this Ray cluster (default: start a local one)")
    serve.add_argument("--max-in-flight", type=int, default=RouterConfig.max_in_flight)
    serve.add_argument("--max-queue", type=int, default=RouterConfig.max_queue)
    serve.add_argument("--drain-grace-s", type=float, default=30.0)
    _add_deploy_args(serve)
    _add_model_args(serve)
    _add_engine_args(serve, "prefill")
    _add_engine_args(serve, "decode")

    gen = sub.add_parser(
        "generate",
        help="generate for one prompt: offline in this process, or from a server with --server",
    )
    add_generate_arguments(gen)
    _add_model_args(gen)
    _add_engine_args(gen)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `pdserve` console script."""
    ns = build_parser().parse_args(argv)
    logging.basicConfig(
        level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if ns.command == "serve":
        return _serve(ns)
    if ns.server:
        from router.client import run_generate

        return asyncio.run(run_generate(ns))
    return _generate_offline(ns)


if __name__ == "__main__":
    sys.exit(main())
