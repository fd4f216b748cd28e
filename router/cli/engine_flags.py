"""The flags of one engine, shared by `pdserve serve` (its `--prefill-*` and `--decode-*`
pools) and offline `pdserve generate`: which model and how it runs, the scheduler and KV
cache knobs, and the `EngineArgs` they become in `engine_args`."""

from __future__ import annotations

import argparse

from engine.args import DEFAULT_PROMPT_GRAPH_MAX_TOKENS, EngineArgs
from engine.core.config import SchedulerConfig
from router.cli.flag_types import at_least, device, number_in, speculative_config


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
            help="no CUDA graphs (CUDA only)",
        ),
        g.add_argument(
            "--prompt-graph-max-tokens",
            type=at_least(0),
            default=DEFAULT_PROMPT_GRAPH_MAX_TOKENS,
            help="CUDA: a step that runs one prompt chunk of up to this many tokens alone "
            "replays a CUDA graph captured at start-up, padded to the next captured count "
            "(0 = off)",
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


def add_parallel_args(p: argparse.ArgumentParser) -> list[argparse.Action]:
    """How many GPUs one worker's model is split over (`pdserve serve`)."""
    g = p.add_argument_group("tensor parallelism")
    pools = [
        g.add_argument(
            f"--{pool}-tensor-parallel-size",
            type=at_least(1),
            metavar="N",
            help=f"GPUs per {pool} worker (default: --tensor-parallel-size)",
        )
        for pool in ("prefill", "decode", "colocated")
    ]
    return [
        g.add_argument(
            "--tensor-parallel-size",
            "-tp",
            type=at_least(1),
            default=1,
            metavar="N",
            help="GPUs (processes) each worker's model is split over, in every pool; the "
            "attention heads must divide by N and the KV heads divide by N or N by them",
        ),
        *pools,
    ]


def tensor_parallel_size(ns: argparse.Namespace, pool: str) -> int:
    """The TP size of `pool`'s workers: its own flag, else --tensor-parallel-size."""
    own = getattr(ns, f"{pool}_tensor_parallel_size", None)
    return int(own if own is not None else getattr(ns, "tensor_parallel_size", 1))


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
        prompt_graph_max_tokens=ns.prompt_graph_max_tokens,
        compile_model=ns.compile_model,
        # True: the engine's own default (one step ahead where it pays), not a forced on.
        async_scheduling=None if ns.async_scheduling else False,
        # The prefill pool stops at the first token: nothing to speculate.
        speculative=None if prefix == "prefill" else ns.speculative_config,
        tensor_parallel_size=tensor_parallel_size(
            ns, "colocated" if getattr(ns, "colocated_workers", 0) else prefix or "decode"
        ),
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
