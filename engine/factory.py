"""Build a ready engine (model runner + scheduler + tokenizer) from user-facing arguments."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.args import (  # noqa: F401 - re-exported: what an engine is built from
    DEFAULT_KV_STREAM_MIN_TOKENS,
    DEFAULT_PROMPT_GRAPH_MAX_TOKENS,
    KV_STREAM_MIN_BYTES,
    EngineArgs,
    kv_stream_min_tokens,
)
from engine.core.config import CacheConfig
from engine.core.engine_core import EngineCore
from engine.core.role import EngineRole
from engine.model.model_spec import ModelSpec
from engine.parallel.tensor_parallel import SINGLE, TPRank
from engine.wire import KVLayout

log = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_GIB = 1.0


@dataclass
class BuiltEngine:
    core: EngineCore
    runner: Any  # engine.model.model_runner.ModelRunner
    tokenizer: Any | None
    spec: ModelSpec
    layout: KVLayout


def _kv_budget_bytes(args: EngineArgs, device: torch.device) -> int:
    if args.kv_cache_gib is not None:
        return int(args.kv_cache_gib * 2**30)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used_by_others = total - free
        return max(int(total * args.gpu_memory_utilization) - used_by_others, 0)
    return int(DEFAULT_CPU_KV_CACHE_GIB * 2**30)


def _load_draft(
    args: EngineArgs, target_path: Path, device: torch.device
) -> tuple[tuple[torch.nn.Module, ModelSpec], float]:
    """The draft model, loaded, and the target's share of the KV budget (by bytes per
    block); ValueError for a draft the target cannot verify."""
    from engine.model.model_loader import load_model
    from engine.spec.draft_model import check_draft_vocabulary

    assert args.speculative is not None and args.speculative.model is not None
    draft_path = Path(args.speculative.model)
    if not (draft_path / "config.json").is_file():
        raise ValueError(f"draft model {draft_path}: no config.json in that folder")
    target = ModelSpec.from_pretrained_dir(target_path)
    check_draft_vocabulary(target, ModelSpec.from_pretrained_dir(draft_path))
    model, draft_spec = load_model(draft_path, args.dtype, device, args.load_format)
    # Both caches run in the loaded dtype.
    per_block = [
        ModelSpec.from_pretrained_dir(p, dtype=draft_spec.dtype).kv_block_bytes(args.block_size)
        for p in (target_path, draft_path)
    ]
    return (model, draft_spec), per_block[0] / sum(per_block)


def longest_graph_chunk(args: EngineArgs, device: torch.device) -> int:
    """The longest prompt chunk a graph need run: a step's token budget and the chunking
    threshold bound every chunk, as `prompt_graph_max_tokens` bounds the graphs."""
    scheduler = args.scheduler.for_device(device.type)
    bounds = [args.prompt_graph_max_tokens, scheduler.max_num_batched_tokens or 0]
    if scheduler.long_prefill_token_threshold:
        bounds.append(scheduler.long_prefill_token_threshold)
    return min(bounds)


def _runner_kwargs(args: EngineArgs, role: EngineRole, device: torch.device) -> dict[str, Any]:
    """What every rank's runner (and a draft model's) is built with."""
    speculative = args.speculative if role.decodes else None
    kw: dict[str, Any] = dict(
        dtype=args.dtype,
        device=str(device),
        load_format=args.load_format,
        block_size=args.block_size,
        enforce_eager=args.enforce_eager,
        # A prefill engine never runs a decode step: graphs of one would only cost
        # start-up time and memory there.
        decode_graphs=role.decodes,
        max_num_seqs=args.scheduler.max_num_seqs,
        compile_model=None if args.compile_model else False,
    )
    if speculative is not None:
        # Verifying steps (and a draft model's first pass) replay graphs of their own,
        # for the batch sizes that speculate.
        kw["verify_graph_tokens"] = 1 + speculative.num_speculative_tokens
        kw["verify_graph_max_seqs"] = speculative.disable_by_batch_size or 0
    return kw


def build_runner(
    args: EngineArgs,
    role: EngineRole,
    tp: TPRank = SINGLE,
    *,
    budget_share: float = 1.0,
) -> Any:
    """One rank's model runner (a tensor-parallel worker's other ranks build only this;
    every rank must build it with the same arguments, at the same time)."""
    from engine.model.model_runner import ModelRunner
    from engine.model.prompt_graphs import prompt_graph_sizes

    device = args.resolve_device()
    return ModelRunner(
        str(args.resolve_model_path()),
        prompt_graph_tokens=prompt_graph_sizes(longest_graph_chunk(args, device)),
        num_blocks=args.num_blocks,
        kv_cache_bytes=(
            None
            if args.num_blocks
            else (lambda: int(_kv_budget_bytes(args, device) * budget_share))
        ),
        tp=tp,
        **_runner_kwargs(args, role, device),
    )


def build_engine(
    args: EngineArgs,
    *,
    role: EngineRole = EngineRole.COLOCATED,
    index: int = 0,
    tp: TPRank = SINGLE,
) -> BuiltEngine:
    """Load the model, size and allocate the KV cache, and wire the scheduler to it;
    `index` names the engine among its pool's in its stats. With `tp` (rank 0 of a
    tensor-parallel group) the runner holds this rank's share; the scheduler plans for
    the group."""
    from engine.model.model_loader import has_tokenizer, load_tokenizer
    from engine.model.model_runner import ModelRunner

    path = args.resolve_model_path()
    device = args.resolve_device()
    speculative = args.speculative if role.decodes else None
    # A draft model is loaded first, so that a GPU budget sees its weights, and its
    # cache takes its share of the budget: the same blocks at its bytes per block. It
    # runs whole on rank 0 (its proposals reach the other ranks inside the step).
    draft = _load_draft(args, path, device) if speculative and speculative.model else None
    share = 1.0 if draft is None else draft[1]
    runner = build_runner(args, role, tp, budget_share=share)
    if draft is not None:
        from engine.spec.draft_model import DraftModel

        assert speculative is not None and speculative.model is not None
        runner.drafter = DraftModel(
            ModelRunner(
                speculative.model,
                num_blocks=runner.num_blocks,
                preloaded=draft[0],
                **_runner_kwargs(args, role, device),
            )
        )
    spec: ModelSpec = runner.spec
    tokenizer = load_tokenizer(str(path)) if has_tokenizer(path) else None
    core = EngineCore(
        runner,
        args.scheduler.for_device(device.type),
        CacheConfig(num_blocks=runner.num_blocks, block_size=args.block_size),
        max_model_len=spec.max_model_len,
        vocab_size=spec.vocab_size,
        eos_token_ids=frozenset(spec.eos_token_ids),
        role=role,
        index=index,
        # A prefill engine hands a request off after one step; running a step ahead would
        # queue its hand-off gather behind the next prefill step (TTFT), for little gain.
        async_scheduling=(
            device.type == "cuda" and role.decodes
            if args.async_scheduling is None
            else args.async_scheduling
        ),
        speculative=args.speculative if role.decodes else None,
    )
    layout = KVLayout(
        model=spec.name,
        dtype=spec.dtype,
        block_size=args.block_size,
        num_layers=spec.num_layers,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        tensor_parallel_size=spec.tensor_parallel_size,
    )
    log.info(
        "engine ready: %s (%s) on %s, %d KV blocks of %d tokens",
        spec.name,
        spec.dtype,
        device,
        runner.num_blocks,
        args.block_size,
    )
    return BuiltEngine(core, runner, tokenizer, spec, layout)
