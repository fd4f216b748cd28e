"""What one engine is built from (`EngineArgs`), without importing torch: the CLI
checks its flags against these before any heavy import, so a usage error is fast."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from engine.core.config import SchedulerConfig
from engine.spec.spec_config import SpeculativeConfig

if TYPE_CHECKING:
    import torch

    from engine.model.model_loader import LoadFormat


# From this much KV on (2048 tokens of the 8B shape), streaming it during the pass pays:
# the hand-off left after the first token and the first inter-token gap shrink, for
# little on the pass. Smaller hand-offs come from passes bound by the host launching
# kernels (shorter prompts, smaller models), where posting the parts costs more than the
# transfer it hides (docs/benchmarks-history.md, "Layer-wise KV streaming").
# `kv_stream_min_tokens="auto"` turns it into a token count for the model being served,
# compared with a message's (one pass's prompts to one decode worker), not a prompt's.
KV_STREAM_MIN_BYTES = 256 << 20
DEFAULT_KV_STREAM_MIN_TOKENS: int | Literal["auto"] = "auto"

# What carries KV between workers (engine.transfer.backends): a process group of each
# pair's own, or a queue between two workers of one process (tests).
KVTransferBackend = Literal["process_group", "fake"]
KV_TRANSFER_BACKENDS: tuple[KVTransferBackend, ...] = ("process_group", "fake")

# The longest prompt chunk that runs alone from a CUDA graph (engine.model.prompt_graphs).
# Past it a pass is bound by the GPU's arithmetic on the models served here (an 8B's
# matmuls take many times its launches), and such a prompt of an 8B streams its KV
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
    # GPUs (processes) one worker's model is split over (engine.parallel.tensor_parallel).
    tensor_parallel_size: int = 1
    # What the worker's KV channels run on (engine.transfer.backends).
    kv_transfer_backend: KVTransferBackend = "process_group"

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
        if self.kv_transfer_backend not in KV_TRANSFER_BACKENDS:
            raise ValueError(
                f"kv_transfer_backend must be one of {KV_TRANSFER_BACKENDS}, "
                f"got {self.kv_transfer_backend!r}"
            )
        if self.kv_transfer_backend == "fake" and self.tensor_parallel_size > 1:
            # A tensor-parallel worker's ranks are processes of their own: their parts of
            # a hand-off cannot travel on one process's queue.
            raise ValueError("the fake KV transfer backend needs tensor_parallel_size 1")
        stream_from = self.kv_stream_min_tokens
        if stream_from != "auto" and not (isinstance(stream_from, int) and stream_from >= 0):
            raise ValueError(f"kv_stream_min_tokens must be 'auto' or >= 0, got {stream_from!r}")

    def resolve_device(self) -> torch.device:
        import torch

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
