"""Paged attention over one block-major KV cache, plugged into transformers' attention interface.

KV cache layout: `kv_cache[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`.
Block-major, so a request's KV for a hand-off is one `index_select` on dim 0.
Reads and writes address the cache as rows of `num_kv_heads * head_dim` contiguous
values (`kv_cache.view(-1, KVH * D)`): one token's K (or V) of one layer is one row, and
row-wise `index_select` / `index_copy_` move whole rows (5x faster on an H200 than
advanced indexing with a (block, offset) index pair).

All index tensors are built once per step (`PagedAttentionMetadata.build`) with tensor
ops on the target device and shared by every layer; the forward pass has no per-request
Python loop and no host sync.

* On CUDA (with Triton) the kernels read K/V through the block tables themselves, so
  nothing is gathered or padded: a pure-decode step runs the split-K decode kernel of
  `engine.model.triton_attention` (shapes independent of context lengths: what CUDA
  graphs need), any step with a prompt chunk runs every sequence, decodes included,
  through the varlen kernel of `engine.model.triton_prefill` in one launch.
* Elsewhere (CPU) sequences are split into decode groups (one query token each) and a
  prefill group, each run as one padded, masked, batched SDPA over gathered rows.
  Decodes of very different context lengths form two groups, so a short sequence does
  not pay for the longest one's padding.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.core.batch import Batch
from engine.model.staging import to_device
from engine.model.triton_attention import (
    num_splits_for,
    paged_decode_attention,
    triton_available,
    use_triton_for,
    write_kv_rows,
)
from engine.model.triton_prefill import paged_varlen_attention

ATTN_IMPLEMENTATION = "pdserve_paged"


@dataclass(frozen=True)
class AttentionGroup:
    """Padded index tensors for `n` sequences attending as one batch.

    A group with `kv_rows`/`mask` runs as one batched SDPA over gathered rows; one
    without (`paged` True: decode groups on CUDA) runs the Triton paged kernel.
    """

    q_index: torch.Tensor  # [n, max_q] packed-token index; padding repeats a valid token
    kv_rows: torch.Tensor | None  # [n, max_kv, 2] cache rows of layer 0's K, V per kv position
    block_table: torch.Tensor  # [n, max_blocks] for kernels that walk blocks themselves
    context_lens: torch.Tensor  # [n] tokens in the cache after this step's writes
    mask: torch.Tensor | None  # [n, 1, max_q, max_kv] bool, True = attend
    out_rows: torch.Tensor  # [m] rows of the flattened [n * max_q] output that are real
    out_tokens: torch.Tensor  # [m] packed-token index each real row belongs to
    max_context: int = 0  # a bound on context_lens (sizes the paged kernel's split count)
    identity: bool = False  # token i is sequence i, all real: no gather/scatter needed

    @property
    def paged(self) -> bool:
        """True when the Triton kernel walks the block tables (no gathered rows)."""
        return self.kv_rows is None


@dataclass(frozen=True)
class VarlenGroup:
    """Every sequence of a step for the Triton varlen kernel: packed, unpadded, one launch."""

    block_table: torch.Tensor  # [n, max_blocks]
    q_starts: torch.Tensor  # [n] packed index of each sequence's first token
    q_lens: torch.Tensor  # [n] tokens each sequence runs this step
    positions: torch.Tensor  # [n] position of that first token
    max_q: int  # the longest chunk (sizes the launch grid)

    paged = True  # the kernel walks the block tables


@dataclass(frozen=True)
class PagedAttentionMetadata:
    """Per-step attention inputs shared by all layers."""

    positions: torch.Tensor  # [T] position of every packed token (the model's position_ids)
    slot_rows: torch.Tensor  # [T] cache row of layer 0's K for each new token
    rows_per_layer: int  # add layer * rows_per_layer to reach a layer's K rows (V: + block_size)
    block_size: int
    # Decode groups first, then prefill; empty ones left out (one VarlenGroup alone when
    # the Triton kernels run a step with prompt chunks).
    groups: tuple[AttentionGroup | VarlenGroup, ...]

    @property
    def num_tokens(self) -> int:
        return int(self.slot_rows.shape[0])

    @classmethod
    def build(
        cls,
        batch: Batch,
        num_layers: int,
        device: torch.device | str,
        bucket_shapes: bool | None = None,
        paged_decode: bool | None = None,
    ) -> PagedAttentionMetadata:
        """Index tensors for one step of `batch` (sequences packed in batch order).

        `paged_decode` (None: on CUDA when Triton imports) runs attention in the Triton
        kernels instead of SDPA.
        """
        for s in batch.seqs:
            if s.num_tokens < 1:
                raise ValueError(f"request {s.req_id}: a scheduled chunk needs >= 1 token")
            if len(s.block_table) * batch.block_size < s.end_position:
                raise ValueError(
                    f"request {s.req_id}: {len(s.block_table)} blocks of {batch.block_size} "
                    f"cannot hold {s.end_position} tokens"
                )
        device = torch.device(device)
        return build_metadata(
            [s.num_tokens for s in batch.seqs],
            [s.start_position for s in batch.seqs],
            [s.block_table for s in batch.seqs],
            batch.block_size,
            num_layers,
            device,
            bucket_shapes=device.type == "cuda" if bucket_shapes is None else bucket_shapes,
            paged_decode=(
                device.type == "cuda" and triton_available()
                if paged_decode is None
                else paged_decode
            ),
        )


def bucket_size(n: int, granule: int) -> int:
    """Round n up to a power of two below `granule`, else to a multiple of `granule`."""
    if n <= granule:
        return 1 << max(n - 1, 0).bit_length()
    return -(-n // granule) * granule


# cuDNN's SDPA (what torch picks on CUDA for a masked GQA call) builds an execution
# graph for every new shape, ~40 ms of host time on an H200, then caches it. Group
# shapes change every step (contexts grow by one), so on CUDA they are rounded up
# to buckets: few distinct graphs, each built once.
_SEQ_GRANULE = 8
_LEN_GRANULE = 256


@dataclass(frozen=True)
class _SeqTensors:
    """Per-sequence facts of one step, on the device."""

    num_q: torch.Tensor  # [n]
    q_start: torch.Tensor  # [n] index of the sequence's first token in the packed batch
    start: torch.Tensor  # [n] position of that token
    table: torch.Tensor  # [n, max_blocks] block tables, zero-padded


def build_metadata(
    num_q: Sequence[int],
    start_positions: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    num_layers: int,
    device: torch.device,
    bucket_shapes: bool = False,
    paged_decode: bool = False,
) -> PagedAttentionMetadata:
    """Metadata from plain lists: per-sequence query counts, start positions and block tables."""
    n = len(num_q)
    num_tokens = sum(num_q)
    q_start = [0] * n
    for i in range(1, n):
        q_start[i] = q_start[i - 1] + num_q[i - 1]
    max_blocks = max((len(t) for t in block_tables), default=1)
    # Small per-sequence tensors travel to the device; everything per token is
    # derived there, so the host does O(num_seqs + num_blocks) work per step.
    table = torch.zeros((n, max_blocks), dtype=torch.long)
    for i, t in enumerate(block_tables):
        table[i, : len(t)] = torch.tensor(t, dtype=torch.long)
    seqs = _SeqTensors(
        num_q=to_device(num_q, torch.long, device),
        q_start=to_device(q_start, torch.long, device),
        start=to_device(start_positions, torch.long, device),
        table=to_device(table, torch.long, device),
    )
    seq_of_token = torch.repeat_interleave(
        torch.arange(n, device=device), seqs.num_q, output_size=num_tokens
    )
    within = torch.arange(num_tokens, device=device) - seqs.q_start[seq_of_token]
    positions = seqs.start[seq_of_token] + within
    slot_block = seqs.table[seq_of_token, positions // block_size]
    # Row of (block b, layer l, k/v c, offset o) in the [-1, KVH*D] view of the cache.
    rows_per_block = num_layers * 2 * block_size
    slot_rows = slot_block * rows_per_block + positions % block_size

    max_q = max(num_q, default=0)
    if paged_decode and max_q > 1:
        varlen = VarlenGroup(
            block_table=seqs.table,
            q_starts=seqs.q_start,
            q_lens=seqs.num_q,
            positions=seqs.start,
            max_q=max_q,
        )
        return PagedAttentionMetadata(
            positions=positions,
            slot_rows=slot_rows,
            rows_per_layer=2 * block_size,
            block_size=block_size,
            groups=(varlen,),
        )

    groups = []
    decode_ids = [i for i in range(n) if num_q[i] == 1]
    prefill_ids = [i for i in range(n) if num_q[i] > 1]
    id_groups = [prefill_ids]
    if paged_decode or bucket_shapes:
        id_groups.insert(0, decode_ids)
    else:
        id_groups[:0] = _split_by_context(decode_ids, start_positions)
    for ids in id_groups:
        if not ids:
            continue
        paged = paged_decode and ids is decode_ids
        identity = len(ids) == n and ids == decode_ids and ids == list(range(n))
        max_q = max(num_q[i] for i in ids)
        max_kv = max(start_positions[i] + num_q[i] for i in ids)
        num_rows = sum(num_q[i] for i in ids)
        num_seqs = len(ids)
        if bucket_shapes:
            num_seqs = bucket_size(num_seqs, _SEQ_GRANULE)
            max_q = bucket_size(max_q, _LEN_GRANULE) if max_q > 1 else 1
            max_kv = bucket_size(max_kv, _LEN_GRANULE)
        # Padding sequences repeat the group's first one: real, finite data whose
        # outputs are never read back.
        num_real = len(ids)
        ids = ids + [ids[0]] * (num_seqs - num_real)
        groups.append(
            _build_group(
                ids,
                num_real,
                seqs,
                max_q,
                max_kv,
                num_rows,
                block_size,
                rows_per_block,
                paged,
                identity=identity and num_seqs == num_real,
            )
        )
    return PagedAttentionMetadata(
        positions=positions,
        slot_rows=slot_rows,
        rows_per_layer=2 * block_size,
        block_size=block_size,
        groups=tuple(groups),
    )


def _split_by_context(ids: list[int], start_positions: Sequence[int]) -> list[list[int]]:
    """Decode sequences as one group, or two when that cuts the padded K/V area by > 1/4.

    A padded group gathers and attends over n x (longest context) positions; with
    ragged contexts (continuous batching) most of that can be padding.
    """
    if len(ids) < 2:
        return [ids]
    order = sorted(ids, key=lambda i: start_positions[i])
    ctx = [start_positions[i] + 1 for i in order]
    one = len(order) * ctx[-1]
    best, cut = one, 0
    for k in range(1, len(order)):
        area = k * ctx[k - 1] + (len(order) - k) * ctx[-1]
        if area < best:
            best, cut = area, k
    if best > 0.75 * one:
        return [ids]
    return [order[:cut], order[cut:]]


def _build_group(
    ids: list[int],
    num_real: int,
    seqs: _SeqTensors,
    max_q: int,
    max_kv: int,
    num_rows: int,
    block_size: int,
    rows_per_block: int,
    paged: bool = False,
    identity: bool = False,
) -> AttentionGroup:
    """Padded index tensors for the sequences `ids` (the first `num_real` are real).

    `paged`: for the Triton kernel, which needs no gathered rows and no mask.
    """
    device = seqs.table.device
    sel = to_device(ids, torch.long, device)
    g_num_q, g_q_start, g_start = seqs.num_q[sel], seqs.q_start[sel], seqs.start[sel]
    context_len = g_start + g_num_q

    j = torch.arange(max_q, device=device)
    q_valid = j[None, :] < g_num_q[:, None]  # [n, max_q]
    q_index = torch.where(q_valid, g_q_start[:, None] + j[None, :], g_q_start[:, None])
    # Padded query rows get position 0: they see kv 0 only, so their softmax has
    # one finite entry (no NaN); their outputs are dropped.
    q_pos = torch.where(q_valid, g_start[:, None] + j[None, :], 0)

    row_seq = torch.repeat_interleave(
        torch.arange(num_real, device=device), g_num_q[:num_real], output_size=num_rows
    )
    row_start = torch.cumsum(g_num_q[:num_real], 0) - g_num_q[:num_real]
    row_within = torch.arange(num_rows, device=device) - row_start[row_seq]
    g_table = seqs.table[sel]
    if paged:
        return AttentionGroup(
            q_index=q_index,
            kv_rows=None,
            block_table=g_table,
            context_lens=context_len,
            mask=None,
            out_rows=row_seq * max_q + row_within,
            out_tokens=g_q_start[row_seq] + row_within,
            max_context=max_kv,
            identity=identity,
        )
    kv_pos = torch.arange(max_kv, device=device)
    kv_valid = kv_pos[None, :] < context_len[:, None]  # [n, max_kv]
    # Padding reads position 0 of the same sequence, a slot it always owns and has
    # written: never a foreign or uninitialised slot (which could hold NaN/inf).
    kv_pos_safe = torch.where(kv_valid, kv_pos[None, :], 0)
    kv_block = g_table[torch.arange(len(ids), device=device)[:, None], kv_pos_safe // block_size]
    mask = (kv_pos[None, None, :] <= q_pos[:, :, None]) & kv_valid[:, None, :]
    k_rows = kv_block * rows_per_block + kv_pos_safe % block_size
    return AttentionGroup(
        q_index=q_index,
        kv_rows=torch.stack((k_rows, k_rows + block_size), dim=-1),
        block_table=g_table,
        context_lens=context_len,
        mask=mask[:, None, :, :],
        out_rows=row_seq * max_q + row_within,
        out_tokens=g_q_start[row_seq] + row_within,
        max_context=max_kv,
        identity=identity,
    )


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
) -> None:
    """One padded SDPA for a group; writes the real rows of its result into `out` [T, H, D]."""
    if group.paged:
        o = _attend_paged(query, kv_cache, layer_idx, group, scale)
        out.index_copy_(0, group.out_tokens, o.index_select(0, group.out_rows))
        return
    o = _attend_sdpa(query, kv_cache, layer_idx, meta, group, scale)
    out_rows = o.transpose(1, 2).reshape(-1, query.shape[1], query.shape[2])
    out.index_copy_(0, group.out_tokens, out_rows.index_select(0, group.out_rows))


def _attend_sdpa(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    layer_idx: int,
    meta: PagedAttentionMetadata,
    group: AttentionGroup,
    scale: float,
) -> torch.Tensor:
    """The group's padded SDPA over gathered K/V rows: [n, H, max_q, D]."""
    assert group.kv_rows is not None and group.mask is not None
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = kv_cache.shape[4]
    n, max_kv, _ = group.kv_rows.shape
    rows = kv_cache.view(-1, num_kv_heads * head_dim)
    # K and V rows side by side: one gather per layer for both.
    kv = rows.index_select(0, (group.kv_rows + layer_idx * meta.rows_per_layer).view(-1))
    kv = kv.view(n, max_kv, 2, num_kv_heads, head_dim)
    k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
    # [n, H, max_q, D]; in a decode step token i is sequence i: nothing to gather.
    q = query.unsqueeze(2) if group.identity else query[group.q_index].transpose(1, 2)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=group.mask, scale=scale, enable_gqa=num_kv_heads != num_heads
    )


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
    through the attention kernel slowed a full batch's loop by 7 % (1B, batch 128,
    `bench.decode_step --kv-write`)."""
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


@dataclass(frozen=True)
class PagedStep:
    """What every layer's attention of one forward pass reads: the step's metadata and
    the whole KV cache (storage, scratch block included)."""

    metadata: PagedAttentionMetadata
    kv_cache: torch.Tensor
    # Called with each layer's index once its K/V are written (queued on the device):
    # layer-wise KV streaming posts that layer's part from here.
    on_layer_written: Callable[[int], None] | None = None


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
        return _attend_sdpa(query, kv_cache, layer_idx, meta, decode, scale)[:, :, 0]
    out = torch.empty_like(query)
    for group in groups:  # decode group(s), then prefill
        assert isinstance(group, AttentionGroup)
        _attend(query, kv_cache, layer_idx, meta, group, scale, out)
    return out


# The same function as an opaque operator for torch.compile: the compiled decoder fuses
# everything around attention and calls this between its kernels (in CUDA graphs too).
@torch.library.custom_op("pdserve::paged_attention", mutates_args=())
def _paged_attention_op(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_idx: int, scale: float
) -> torch.Tensor:
    # The compiler lays out later kernels from the fake's (contiguous) strides.
    return paged_attention(query, key, value, layer_idx, scale).contiguous()


@_paged_attention_op.register_fake
def _(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_idx: int, scale: float
) -> torch.Tensor:
    return torch.empty_like(query, memory_format=torch.contiguous_format)


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
    layer_idx: int = module.layer_idx  # type: ignore[assignment]
    scale = scaling if scaling is not None else float(module.scaling)  # type: ignore[arg-type]
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    if torch.compiler.is_compiling():
        # Contiguous here costs nothing: the compiler writes them so in the rotary kernel.
        out = _paged_attention_op(q.contiguous(), k.contiguous(), v.contiguous(), layer_idx, scale)
    else:
        out = paged_attention(q, k, v, layer_idx, scale)
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
