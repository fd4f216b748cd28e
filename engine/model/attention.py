"""Paged attention over one block-major KV cache, plugged into transformers' attention interface.

KV cache layout: `kv_cache[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`.
Block-major, so a request's KV for a hand-off is one `index_select` on dim 0.
Reads and writes address the cache as rows of `num_kv_heads * head_dim` contiguous
values (`kv_cache.view(-1, KVH * D)`): one token's K (or V) of one layer is one row, and
row-wise `index_select` / `index_copy_` move whole rows (far faster on a GPU than
advanced indexing with a (block, offset) index pair).

All index tensors are built once per step (`engine.model.attention_metadata`) and
shared by every layer; the forward pass has no per-request Python loop and no host sync.

* On CUDA (with Triton) the kernels read K/V through the block tables themselves, so
  nothing is gathered or padded: a pure-decode step runs the split-K decode kernel of
  `engine.model.kernels.triton_attention` (shapes independent of context lengths: what CUDA
  graphs need), any step with a prompt chunk runs every sequence, decodes included,
  through the varlen kernel of `engine.model.kernels.triton_prefill` in one launch.
* Elsewhere (CPU) sequences are split into decode groups (one query token each) and a
  prefill group, each run as one padded, masked, batched SDPA over gathered K/V (on
  CPU whole blocks: a block's K, or V, of one layer is `block_size` contiguous rows,
  gathered into one scratch buffer per step; a decode group whose sequences all attend
  the same context needs no mask).
  Decodes of very different context lengths form two groups, so a short sequence does
  not pay for the longest one's padding.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.model.attention_metadata import (
    AttentionGroup,
    PagedAttentionMetadata,
    VarlenGroup,
)
from engine.model.kernels.triton_attention import (
    num_splits_for,
    paged_decode_attention,
    use_triton_for,
    write_kv_rows,
)
from engine.model.kernels.triton_prefill import paged_varlen_attention

ATTN_IMPLEMENTATION = "pdserve_paged"


def write_kv(
    kv_cache: torch.Tensor,
    layer_idx: int,
    key: torch.Tensor,
    value: torch.Tensor,
    meta: PagedAttentionMetadata,
) -> None:
    """Store the step's new K/V ([T, KVH, D] each) into their slots of layer `layer_idx`."""
    rows = kv_cache.view(-1, key.shape[1] * key.shape[2])
    if use_triton_for(kv_cache):
        offset = layer_idx * meta.rows_per_layer
        write_kv_rows(rows, key, value, meta.slot_rows, offset, meta.block_size)
        return
    if meta.kv_slot_rows is not None:
        kv = torch.cat((key, value)).view(-1, rows.shape[1])
        rows.index_copy_(0, meta.kv_slot_rows + layer_idx * meta.rows_per_layer, kv)
        return
    k_rows = meta.slot_rows + layer_idx * meta.rows_per_layer
    rows.index_copy_(0, k_rows, key.reshape(key.shape[0], -1))
    rows.index_copy_(0, k_rows + meta.block_size, value.reshape(value.shape[0], -1))


def _attend(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    layer_idx: int,
    meta: PagedAttentionMetadata,
    group: AttentionGroup,
    scale: float,
    out: torch.Tensor,
    scratch: GatherScratch,
) -> None:
    """One padded SDPA for a group; writes the real rows of its result into `out` [T, H, D]."""
    if group.paged:
        o = _attend_paged(query, kv_cache, layer_idx, group, scale)
        out.index_copy_(0, group.out_tokens, o.index_select(0, group.out_rows))
        return
    o = _attend_sdpa(query, kv_cache, layer_idx, meta, group, scale, scratch)
    out_rows = o.transpose(1, 2).reshape(-1, query.shape[1], query.shape[2])
    out.index_copy_(0, group.out_tokens, out_rows.index_select(0, group.out_rows))


def _attend_sdpa(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    layer_idx: int,
    meta: PagedAttentionMetadata,
    group: AttentionGroup,
    scale: float,
    scratch: GatherScratch,
) -> torch.Tensor:
    """The group's padded SDPA over gathered K/V: [n, H, max_q, D]."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = kv_cache.shape[4]
    k, v = _gather_kv(kv_cache, layer_idx, meta, group, scratch)
    n, max_q = group.q_index.shape
    if max_q == 1 and group.kv_blocks is not None and num_kv_heads != num_heads:
        # One query token a sequence (CPU): the query heads that share a KV head become
        # that head's rows, as transformers packs them: SDPA runs one product per KV
        # head instead of one per query head, each reading the head's K/V once.
        q = query if group.identity else query.index_select(0, group.q_index[:, 0])
        q = q.reshape(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, scale=scale)
        return o.view(n, num_heads, 1, head_dim)
    # [n, H, max_q, D]; in a decode step token i is sequence i: nothing to gather.
    q = query.unsqueeze(2) if group.identity else query[group.q_index].transpose(1, 2)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=group.mask, scale=scale, enable_gqa=num_kv_heads != num_heads
    )


def _gather_kv(
    kv_cache: torch.Tensor,
    layer_idx: int,
    meta: PagedAttentionMetadata,
    group: AttentionGroup,
    scratch: GatherScratch,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The group's K and V of layer `layer_idx`, each [n, KVH, max_kv, D]: gathered by
    whole blocks (`kv_blocks`, CPU, into the step's scratch) or by rows, K and V side by
    side: one gather per layer for both."""
    _, _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    if group.kv_blocks is not None:
        n, _, num_blocks = group.kv_blocks.shape
        blocks = kv_cache.view(-1, block_size * num_kv_heads * head_dim)
        index = (group.kv_blocks + 2 * layer_idx).view(-1)
        kv = torch.index_select(blocks, 0, index, out=scratch.take(index.shape[0], blocks))
        if group.kv_tail is not None and group.kv_tail.numel():
            kv.view(-1, num_kv_heads * head_dim).index_fill_(0, group.kv_tail, 0)
        kv = kv.view(n, 2, num_blocks * block_size, num_kv_heads, head_dim)
        kv = kv[:, :, : group.max_context]
        return kv[:, 0].transpose(1, 2), kv[:, 1].transpose(1, 2)
    assert group.kv_rows is not None
    n, max_kv, _ = group.kv_rows.shape
    rows = kv_cache.view(-1, num_kv_heads * head_dim)
    kv = rows.index_select(0, (group.kv_rows + layer_idx * meta.rows_per_layer).view(-1))
    kv = kv.view(n, max_kv, 2, num_kv_heads, head_dim)
    return kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)


def _attend_paged(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    layer_idx: int,
    group: AttentionGroup,
    scale: float,
    new_kv: tuple[torch.Tensor, torch.Tensor, PagedAttentionMetadata] | None = None,
) -> torch.Tensor:
    """The Triton paged kernel for a decode group: [n, H, D] for its n sequences.

    `new_kv`: an identity group's new K and V, not yet in the cache. When the step splits
    each context (few sequences, where launches cost more than bytes) the attention
    kernel writes them itself; otherwise the write kernel runs first, since carrying them
    through the attention kernel slowed a full batch's loop (docs/benchmarks-history.md,
    "packed sibling projections and the K/V write in the decode kernel")."""
    q = query if group.identity else query.index_select(0, group.q_index[:, 0])
    n = q.shape[0]
    splits = num_splits_for(n, kv_cache.shape[4], group.max_context, q.device)
    new_key = new_value = None
    if new_kv is not None:
        key, value, meta = new_kv
        if splits == 1:
            write_kv(kv_cache, layer_idx, key, value, meta)
        else:
            new_key, new_value = key, value
    return paged_decode_attention(
        q,
        kv_cache,
        layer_idx,
        group.block_table,
        group.context_lens,
        scale,
        splits,
        new_key=new_key,
        new_value=new_value,
    )


class GatherScratch:
    """Where a step's SDPA groups gather their blocks (CPU): one buffer that every layer
    and group of the step fills in turn, each gather read by its SDPA before the next
    one. Written again and again, it stays in the CPU's caches, where a new tensor
    for every gather costs an allocation and a write to memory nothing has touched
    lately."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def take(self, rows: int, like: torch.Tensor) -> torch.Tensor:
        """A [rows, like.shape[1]] tensor of `like`'s dtype and device, contents undefined
        (another gather's)."""
        numel = rows * like.shape[1]
        buffer = self._buffer
        if buffer is None or buffer.numel() < numel or buffer.dtype != like.dtype:
            buffer = self._buffer = like.new_empty(numel)
        return buffer[:numel].view(rows, like.shape[1])


@dataclass(frozen=True)
class PagedStep:
    """What every layer's attention of one forward pass reads: the step's metadata and
    the whole KV cache (storage, scratch block included)."""

    metadata: PagedAttentionMetadata
    kv_cache: torch.Tensor
    # Called with each layer's index once its K/V are written (queued on the device):
    # layer-wise KV streaming posts that layer's part from here.
    on_layer_written: Callable[[int], None] | None = None
    scratch: GatherScratch = field(default_factory=GatherScratch)


# The step being run by this thread. A thread-local, not a model keyword, so that a
# compiled decoder sees only tensors: the metadata is plain Python that would otherwise
# become graph guards (and a recompile every step).
_current = threading.local()


@contextmanager
def paged_step(
    metadata: PagedAttentionMetadata,
    kv_cache: torch.Tensor,
    on_layer_written: Callable[[int], None] | None = None,
) -> Iterator[None]:
    """Run the model's forward inside this block: its attention layers use this step."""
    previous = getattr(_current, "step", None)
    _current.step = PagedStep(metadata, kv_cache, on_layer_written)
    try:
        yield
    finally:
        _current.step = previous


def _current_step() -> PagedStep:
    step: PagedStep | None = getattr(_current, "step", None)
    if step is None:
        raise RuntimeError(
            f"{ATTN_IMPLEMENTATION} attention runs only inside `with paged_step(...)`; "
            "use engine.model.model_runner.ModelRunner"
        )
    return step


def paged_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_idx: int, scale: float
) -> torch.Tensor:
    """Write this step's K/V into layer `layer_idx` and attend: [T, H, D] from query
    [T, H, D] and key/value [T, KVH, D], over the current `paged_step`."""
    step = _current_step()
    out = _write_and_attend(step, query, key, value, layer_idx, scale)
    if step.on_layer_written is not None:
        step.on_layer_written(layer_idx)
    return out


def _write_and_attend(
    step: PagedStep,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer_idx: int,
    scale: float,
) -> torch.Tensor:
    meta, kv_cache = step.metadata, step.kv_cache
    groups = meta.groups
    first = groups[0]
    # A pure decode step: token i is sequence i, no gather and no scatter.
    decode = first if isinstance(first, AttentionGroup) and first.identity else None
    if decode is not None and decode.paged:
        # The Triton path writes the new K/V, in a kernel of its own or the attention's.
        return _attend_paged(query, kv_cache, layer_idx, decode, scale, (key, value, meta))
    # Write first: a sequence's new tokens must see their own K/V.
    write_kv(kv_cache, layer_idx, key, value, meta)
    if isinstance(first, VarlenGroup):  # a step with prompt chunks, on the Triton path
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        paged_varlen_attention(
            query,
            kv_cache,
            layer_idx,
            first.block_table,
            first.q_starts,
            first.q_lens,
            first.positions,
            first.max_q,
            scale,
            out=out,
        )
        return out
    if decode is not None:
        return _attend_sdpa(query, kv_cache, layer_idx, meta, decode, scale, step.scratch)[:, :, 0]
    out = torch.empty_like(query)
    for group in groups:  # decode group(s), then prefill
        assert isinstance(group, AttentionGroup)
        _attend(query, kv_cache, layer_idx, meta, group, scale, out, step.scratch)
    return out


# The same function as an opaque operator for torch.compile: the compiled decoder fuses
# everything around attention and calls this between its kernels (in CUDA graphs too).
# The layer comes as a one-element CPU tensor, not an int: the compiler specialises a
# module's int attributes, so with `layer_idx` every decoder layer would compile its own
# graph, where with a tensor one compiled layer serves them all (engine.model.compiled).
@torch.library.custom_op("pdserve::paged_attention", mutates_args=())
def _paged_attention_op(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: torch.Tensor, scale: float
) -> torch.Tensor:
    # The compiler lays out later kernels from the fake's (contiguous) strides.
    return paged_attention(query, key, value, int(layer), scale).contiguous()


@_paged_attention_op.register_fake
def _(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: torch.Tensor, scale: float
) -> torch.Tensor:
    return torch.empty_like(query, memory_format=torch.contiguous_format)


# The attribute of an attention module that holds its layer as a tensor (set by
# `tag_layers`): what the compiled decoder passes to the operator.
LAYER_TENSOR = "pdserve_layer"


def tag_layers(model: torch.nn.Module) -> None:
    """Give every attention module its layer index as a CPU tensor (see the operator)."""
    for module in model.modules():
        layer_idx = getattr(module, "layer_idx", None)
        if isinstance(layer_idx, int) and not hasattr(module, LAYER_TENSOR):
            # A non-persistent buffer: an input of the compiled graph, not a constant
            # it guards on, and never in a checkpoint.
            module.register_buffer(LAYER_TENSOR, torch.tensor(layer_idx), persistent=False)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers attention fn: query [1, H, T, D], key/value [1, KVH, T, D] → [1, T, H, D]."""
    scale = scaling if scaling is not None else float(module.scaling)  # type: ignore[arg-type]
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    if torch.compiler.is_compiling():
        # Contiguous here costs nothing: the compiler writes them so in the rotary kernel.
        layer = getattr(module, LAYER_TENSOR)
        out = _paged_attention_op(q.contiguous(), k.contiguous(), v.contiguous(), layer, scale)
    else:
        out = paged_attention(q, k, v, module.layer_idx, scale)  # type: ignore[arg-type]
    return out.unsqueeze(0), None


def register_paged_attention() -> str:
    """Register the attention fn with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    # No mask function is registered on purpose: in transformers 5.24 mask creation
    # exits early, returning None without building a T×T mask, for any
    # implementation absent from AttentionMaskInterface (masking_utils.py,
    # _preprocess_mask_arguments). Registering one would only add work.
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION
