"""Build a ready engine (model runner + scheduler + tokenizer) from user-facing arguments."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from engine.core.config import CacheConfig, SchedulerConfig
from engine.core.engine_core import EngineCore
from engine.core.role import EngineRole
from engine.core.spec_config import SpeculativeConfig
from engine.model.model_spec import ModelSpec
from engine.model.tensor_parallel import SINGLE, TPRank
from engine.transfer.layout import KVLayout

if TYPE_CHECKING:
    from engine.model.model_loader import LoadFormat

log = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_GIB = 1.0


# From this much KV on (2048 tokens of the 8B shape), streaming it during the pass pays:
# the hand-off after the first token shrinks 3-4x and the first inter-token gap by about
# a fifth, for ~3 % on the pass. Smaller hand-offs come from passes bound by the host
# launching kernels (shorter prompts, smaller models), where posting the parts costs more
# than the transfer it hides (docs/benchmarks.md, "Layer-wise KV streaming").
# `kv_stream_min_tokens="auto"` turns it into a token count for the model being served,
# compared with a message's (one pass's prompts to one decode worker), not a prompt's.
KV_STREAM_MIN_BYTES = 256 << 20
DEFAULT_KV_STREAM_MIN_TOKENS: int | Literal["auto"] = "auto"

# The longest prompt chunk that runs alone from a CUDA graph (engine.model.prompt_graphs).
# Past it a pass is bound by the GPU's arithmetic on the models served here (8B: ~40 ms
# of matmuls against a few ms of launches), and such a prompt of an 8B streams its KV
# layer by layer, which runs eagerly anyway.
DEFAULT_PROMPT_GRAPH_MAX_TOKENS = 2048


def kv_stream_min_tokens(setting: int | Literal["auto"], kv_bytes_per_token: float) -> int:
    """The fewest prompt tokens a hand-off message (one pass's prompts to one receiver)
    carries to stream: `setting` itself, or for "auto" the count whose KV reaches
    KV_STREAM_MIN_BYTES (2048 tokens at 8B, 8192 at 1B)."""
    if setting != "auto":
        return setting
    return max(1, math.ceil(KV_STREAM_MIN_BYTES / kv_bytes_per_token))


@dataclass(frozen=True)
class EngineArgs:
    """Everything needed to build one engine; shared by the offline API and both pools."""

    model: str | None = None  # None = the embedded SmolLM2-135M-Instruct
    dtype: str | None = None  # None = float32 on CPU, bfloat16 on CUDA
    device: str = "auto"  # auto = cuda if this process sees a GPU
    load_format: LoadFormat = "auto"  # "dummy" = random weights from config.json
    block_size: int = 16
    num_blocks: int | None = None  # None = sized from kv_cache_gib / gpu_memory_utilization
    kv_cache_gib: float | None = None
    gpu_memory_utilization: float = 0.85
    enforce_eager: bool = False  # True: no CUDA graphs (CUDA only)
    # CUDA: a step that runs one prompt chunk of up to this many tokens, alone, replays
    # a graph captured at start-up (0 = such steps run eagerly).
    prompt_graph_max_tokens: int = DEFAULT_PROMPT_GRAPH_MAX_TOKENS
    compile_model: bool = True  # CUDA: torch.compile the decoder at start-up (model.compiled)
    # Schedule step N+1 while the device runs step N (engine.core.engine_core).
    # None: on CUDA, except prefill engines (on a CPU the step runs on the host: nothing
    # to hide).
    async_scheduling: bool | None = None
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # Prefill workers: hand-offs of prompts this long stream their KV layer by layer
    # during the forward pass (engine.transfer.streaming); shorter ones go in one message.
    kv_stream_min_tokens: int | Literal["auto"] = DEFAULT_KV_STREAM_MIN_TOKENS
    # Speculative decoding (decode and colocated engines; a prefill engine ignores it).
    speculative: SpeculativeConfig | None = None
    # GPUs (processes) one worker's model is split over (engine.model.tensor_parallel).
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.kv_cache_gib is not None and self.kv_cache_gib <= 0:
            raise ValueError(f"kv_cache_gib must be > 0, got {self.kv_cache_gib}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.prompt_graph_max_tokens < 0:
            raise ValueError(
                f"prompt_graph_max_tokens must be >= 0, got {self.prompt_graph_max_tokens}"
            )
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        stream_from = self.kv_stream_min_tokens
        if stream_from != "auto" and not (isinstance(stream_from, int) and stream_from >= 0):
            raise ValueError(f"kv_stream_min_tokens must be 'auto' or >= 0, got {stream_from!r}")

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolve_model_path(self) -> Path:
        if self.model is not None:
            path = Path(self.model)
            if not (path / "config.json").is_file():
                raise ValueError(f"--model {self.model}: no config.json in that folder")
            return path
        from engine.model.embedded import ensure_embedded_model

        return ensure_embedded_model()


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
    from engine.model.draft_model import check_draft_vocabulary
    from engine.model.model_loader import load_model

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
        from engine.model.draft_model import DraftModel

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
