"""A model runner's start-up (engine.model.model_runner.ModelRunner builds itself with
these): which CUDA graphs it will capture, the model's kernels, how many KV blocks its
budget holds, and then the compiled decoder warmed up and the graphs captured, each
falling back to a slower path with a warning rather than failing the start."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.core.batch import Batch, ScheduledSeq
from engine.model.attention import register_paged_attention
from engine.model.compiled import compile_decoder, is_compiled, uncompile_decoder
from engine.model.cpu_linear import use_onednn_linears
from engine.model.cuda_graphs import DecodeGraphs, captured_or_none, graph_batch_sizes
from engine.model.kernels.triton_attention import triton_available
from engine.model.kernels.triton_gemv import use_gemv
from engine.model.model_spec import ModelSpec
from engine.model.prompt_graphs import PromptGraphs, within_context
from engine.model.startup.startup_log import startup_phase
from engine.model.verify_graphs import capture_verify_graphs
from engine.parallel.tensor_parallel import TPRank, min_over_group
from engine.sampling_params import GREEDY

if TYPE_CHECKING:
    from engine.model.model_runner import ModelRunner

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GraphPlan:
    """The CUDA graphs a runner will capture: decode steps' (`decode`), and lone prompt
    chunks' padded to `prompt_tokens`; `scratch` blocks past the cache take the graphs'
    padding rows' K/V (0 or 1)."""

    decode: bool
    prompt_tokens: tuple[int, ...]

    @property
    def scratch(self) -> int:
        return int(self.decode or bool(self.prompt_tokens))


def plan_graphs(
    device: torch.device,
    enforce_eager: bool,
    decode_graphs: bool,
    prompt_graph_tokens: Sequence[int],
    max_model_len: int,
) -> GraphPlan:
    """Graphs on CUDA unless `enforce_eager`, and only where Triton imports (the graphs'
    attention is its kernels)."""
    any_graphs = device.type == "cuda" and not enforce_eager
    if any_graphs and not triton_available():
        log.warning("triton does not import: CUDA graphs off, attention runs SDPA")
        any_graphs = False
    prompt_tokens = within_context(prompt_graph_tokens if any_graphs else (), max_model_len)
    return GraphPlan(any_graphs and decode_graphs, tuple(prompt_tokens))


def prepare_model(
    model: torch.nn.Module,
    device: torch.device,
    small_batch_gemv: bool | None,
    compile_model: bool | None,
    compile_scope: str,
    onednn_linears: bool | None = None,
) -> None:
    """The model's attention through the paged cache, and (None: on CUDA when Triton
    imports) one-row products by the Triton GEMV and the decoder compiled; on CPU
    (None: unless compiled) float32 linear layers by oneDNN (engine.model.cpu_linear)."""
    # nn.Module's __getattr__ types every attribute as Tensor | Module.
    model.set_attn_implementation(register_paged_attention())  # type: ignore[operator]
    use_triton = device.type == "cuda" and triton_available()
    if use_triton if small_batch_gemv is None else small_batch_gemv:
        use_gemv(model)
    compile_it = use_triton if compile_model is None else compile_model
    if device.type == "cpu" and (not compile_it if onednn_linears is None else onednn_linears):
        use_onednn_linears(model)
    if compile_it:
        compile_decoder(model, compile_scope)


def cache_blocks(
    spec: ModelSpec,
    block_size: int,
    num_blocks: int | None,
    kv_cache_bytes: int | Callable[[], int] | None,
    scratch: int,
    tp: TPRank,
    device: torch.device,
) -> int:
    """The blocks the cache holds: `num_blocks`, or as many as the budget holds with the
    graphs' scratch blocks; on a tensor-parallel group, the fewest any rank's holds."""
    if num_blocks is None:
        assert kv_cache_bytes is not None
        if callable(kv_cache_bytes):
            # Measured now that the weights are resident (a GPU budget must see them).
            kv_cache_bytes = kv_cache_bytes()
        per_block = spec.kv_block_bytes(block_size)
        num_blocks = kv_cache_bytes // per_block - scratch
        if num_blocks < 1:
            raise ValueError(
                f"a KV cache budget of {kv_cache_bytes} bytes holds no block of "
                f"{per_block} bytes; raise the budget or lower block_size"
            )
    # Every rank's cache holds the same blocks (its heads of each): the fewest any fits.
    num_blocks = min_over_group(num_blocks, tp, device)
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    return num_blocks


def warm_up_and_capture(
    runner: ModelRunner,
    plan: GraphPlan,
    max_num_seqs: int,
    cuda_graph_batch_sizes: Sequence[int] | None,
    verify_graph_tokens: int,
    verify_graph_max_seqs: int,
) -> None:
    """Compile the decoder now, not on the first request, then capture the planned
    graphs: decode steps, verifying steps (`verify_graph_tokens` >= 2, only with decode
    graphs) and lone prompt chunks."""
    if is_compiled(runner.model):
        # The same first shapes in every engine, whether it captures graphs or not:
        # the compiler's choices may follow the shapes it first sees.
        with startup_phase("compile"):
            _warm_up_compiled(runner)
    max_blocks = min(-(-runner.spec.max_model_len // runner.block_size), runner.num_blocks)
    if plan.decode:
        sizes = cuda_graph_batch_sizes or graph_batch_sizes(max_num_seqs)
        with startup_phase("cuda_graphs", f"batch sizes {list(sizes)}"):
            capture_decode_graphs(runner, sizes, max_blocks)
        if verify_graph_tokens >= 2 and runner.cuda_graphs is not None:
            limit = min(verify_graph_max_seqs or max_num_seqs, max_num_seqs)
            runner.verify_graphs = capture_verify_graphs(
                runner.model,
                runner._kv_storage,
                graph_batch_sizes(limit),
                max_blocks,
                verify_graph_tokens,
            )
    if plan.prompt_tokens:
        tokens = plan.prompt_tokens
        with startup_phase("prompt_graphs", f"token counts {sorted(tokens)}"):
            graphs = PromptGraphs(
                runner.model,
                runner._kv_storage,
                scratch_block=runner.num_blocks,
                block_size=runner.block_size,
                max_blocks_per_seq=max_blocks,
                token_counts=tokens,
            )
            runner.prompt_graphs = captured_or_none(graphs, "lone prompt chunks")


def capture_decode_graphs(
    runner: ModelRunner, batch_sizes: Sequence[int], max_blocks_per_seq: int
) -> None:
    """Capture decode graphs now (start-up), or stay eager with a warning if that fails
    (after one more try with the decoder uncompiled, if it was compiled)."""
    graphs = DecodeGraphs(
        runner.model,
        runner._kv_storage,
        runner._last_tokens,
        scratch_block=runner.num_blocks,
        block_size=runner.block_size,
        max_blocks_per_seq=max_blocks_per_seq,
        batch_sizes=batch_sizes,
    )
    try:
        graphs.capture()
    except Exception:
        if not is_compiled(runner.model):
            log.warning("CUDA graph capture failed; decode runs eagerly", exc_info=True)
            return
        log.warning("the compiled decoder failed; running it uncompiled", exc_info=True)
        uncompile_decoder(runner.model)
        capture_decode_graphs(runner, batch_sizes, max_blocks_per_seq)
        return
    runner.cuda_graphs = graphs


def _warm_up_compiled(runner: ModelRunner) -> None:
    """Run the compiler's two graphs (one token; a symbolic count) on a dummy step, or
    fall back to the uncompiled decoder with a warning. The dummy K/V land in blocks
    no request holds yet."""
    table = tuple(range(min(2, runner.num_blocks)))
    try:
        for n in (min(2, len(table) * runner.block_size), 1):
            seq = ScheduledSeq("compile-warm-up", (0,) * n, 0, table, True, GREEDY, 0)
            runner.execute(Batch((seq,), runner.block_size))
    except Exception:
        log.warning("the compiled decoder failed; running it uncompiled", exc_info=True)
        uncompile_decoder(runner.model)
