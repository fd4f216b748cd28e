"""Paged decode attention in Triton: K/V read straight through the block tables.

One query token per sequence. The kernel is split-K ("flash decoding"): program
(seq, kv_head, split) walks its share of the sequence's context, 16+ tokens a tile,
looking up each token's block in the block table, and keeps an online softmax for
all query heads that share the kv head (GQA: they are one tile of the `tl.dot`).
A second kernel merges the splits by their log-sum-exp. Nothing is gathered into
padded tensors, and the launch grid depends only on (batch size, kv heads, splits),
never on the context lengths, so a captured CUDA graph replays it for any context.

Cache layout (engine.model.attention): `[num_blocks, num_layers, 2, block_size, KVH, D]`.
"""

from __future__ import annotations

import functools

import torch

from engine.model.kernels.triton_paged import tl, triton

if triton is not None:
    from engine.model.kernels.triton_paged import attend_tile, kv_row

# Context tokens per tile. On an H200 (one 8B layer, context 2048) 64 beat 32 and 16 at
# batch 1, 32 and 128 (the retired `bench.decode_step`, docs/benchmarks-history.md).
_BLOCK_N = 64
_MAX_SPLITS = 32
_MIN_TOKENS_PER_SPLIT = 64  # one tile: below this a split's fixed cost outweighs the parallelism


def triton_available() -> bool:
    """True when Triton imports (its kernels still need CUDA tensors, or TRITON_INTERPRET=1)."""
    return triton is not None


def use_triton_for(tensor: torch.Tensor) -> bool:
    """Whether the Triton kernels serve attention for tensors like `tensor` (CUDA + Triton)."""
    return tensor.is_cuda and triton is not None


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_splits_for(
    num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device | None = None
) -> int:
    """Splits per (sequence, kv head): enough programs to fill the GPU twice over, no more
    than the longest context can feed with `_MIN_TOKENS_PER_SPLIT` tokens each."""
    num_sms = _num_sms(device.index or 0) if device is not None and device.type == "cuda" else 132
    programs = max(num_seqs * num_kv_heads, 1)
    want = max(1, -(-2 * num_sms // programs))
    cap = max(1, max_context // _MIN_TOKENS_PER_SPLIT)
    splits = min(want, cap, _MAX_SPLITS)
    return 1 << (splits.bit_length() - 1)  # a power of two: few kernel variants


if triton is not None:

    @triton.jit
    def _decode_split_kernel(
        q_ptr,
        kv_ptr,
        table_ptr,
        ctx_ptr,
        out_ptr,  # [n, H, D] when NUM_SPLITS == 1, else [n, H, S, D] float32
        lse_ptr,  # [n, H, S] float32 (unused when NUM_SPLITS == 1)
        new_k_ptr,  # [n, KVH, D]: each sequence's newest K (WRITE_NEW only)
        new_v_ptr,
        kv_layer_offset,  # elements from a block's start to this layer's K
        stride_q_seq,
        stride_q_head,
        stride_kv_block,
        stride_kv_kv,  # K → V
        stride_kv_tok,
        stride_kv_head,
        stride_table_seq,
        stride_out_seq,
        stride_out_head,
        stride_out_split,
        stride_new_k_seq,
        stride_new_k_head,
        stride_new_v_seq,
        stride_new_v_head,
        qk_scale,  # softmax scale * log2(e)
        BLOCK_SIZE: tl.constexpr,
        GROUP: tl.constexpr,  # query heads per kv head
        GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        IEEE: tl.constexpr,  # float32 inputs: exact dots, not tf32
        WRITE_NEW: tl.constexpr,
    ):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        ctx = tl.load(ctx_ptr + seq).to(tl.int32)
        per_split = tl.cdiv(tl.cdiv(ctx, NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = split * per_split
        end = tl.minimum(start + per_split, ctx)

        offs_g = tl.arange(0, GROUP_PAD)
        offs_d = tl.arange(0, BLOCK_D)
        heads = kv_head * GROUP + offs_g
        g_mask = offs_g < GROUP
        d_mask = offs_d < HEAD_DIM
        q = tl.load(
            q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + offs_d[None, :],
            mask=g_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
        table_row = table_ptr + seq.to(tl.int64) * stride_table_seq
        last = ctx - 1
        if WRITE_NEW:
            # The newest position's K/V come as inputs, not from the cache: the loop skips
            # it, the split that holds it adds it last and then writes it into the cache,
            # so a decode step needs no separate write kernel and no program waits on a
            # store before its first tile. The inputs load before the loop.
            has_new = (last >= start) & (last < end)
            src = seq.to(tl.int64) * stride_new_k_seq + kv_head * stride_new_k_head
            new_k = tl.load(new_k_ptr + src + offs_d, mask=d_mask & has_new, other=0.0)
            src = seq.to(tl.int64) * stride_new_v_seq + kv_head * stride_new_v_head
            new_v = tl.load(new_v_ptr + src + offs_d, mask=d_mask & has_new, other=0.0)
        for tile in range(start, end, BLOCK_N):
            pos = tile + tl.arange(0, BLOCK_N)
            valid = pos < end
            if WRITE_NEW:
                valid = valid & (pos != last)
            # WRITE_NEW: a first tile of only the skipped position must keep exp2 finite.
            m_i, l_i, acc = attend_tile(
                q,
                m_i,
                l_i,
                acc,
                kv_ptr,
                table_row,
                pos,
                valid,
                pos,  # one query token, after every position: no causal mask
                offs_d,
                d_mask,
                kv_layer_offset,
                kv_head,
                stride_kv_block,
                stride_kv_kv,
                stride_kv_tok,
                stride_kv_head,
                qk_scale,
                BLOCK_SIZE,
                IEEE,
                False,
                WRITE_NEW,
            )

        if WRITE_NEW:  # noqa: SIM102 (a constexpr branch around a run-time one)
            if has_new:
                qk_new = tl.sum(q.to(tl.float32) * new_k.to(tl.float32)[None, :], 1) * qk_scale
                m_new = tl.maximum(m_i, qk_new)
                alpha = tl.math.exp2(m_i - m_new)
                p_new = tl.math.exp2(qk_new - m_new)
                l_i = l_i * alpha + p_new
                acc = acc * alpha[:, None] + p_new[:, None] * new_v.to(tl.float32)[None, :]
                m_i = m_new
                block = tl.load(table_row + last // BLOCK_SIZE).to(tl.int64)
                dst = (
                    kv_ptr
                    + kv_row(
                        block,
                        last,
                        kv_layer_offset,
                        kv_head,
                        stride_kv_block,
                        stride_kv_tok,
                        stride_kv_head,
                        BLOCK_SIZE,
                    )
                    + offs_d
                )
                tl.store(dst, new_k.to(kv_ptr.dtype.element_ty), mask=d_mask)
                tl.store(dst + stride_kv_kv, new_v.to(kv_ptr.dtype.element_ty), mask=d_mask)

        # An empty split (start >= ctx) leaves l_i == 0: output 0, lse -inf (weight 0).
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        out_offs = (
            seq.to(tl.int64) * stride_out_seq
            + heads[:, None] * stride_out_head
            + split * stride_out_split
            + offs_d[None, :]
        )
        out_mask = g_mask[:, None] & d_mask[None, :]
        if NUM_SPLITS == 1:
            tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=out_mask)
        else:
            tl.store(out_ptr + out_offs, out, mask=out_mask)
            lse = tl.where(l_i > 0, m_i + tl.math.log2(l_i), float("-inf"))
            # lse is [n, H, S] contiguous; H = kv heads (the grid's dim 1) * GROUP.
            lse_row = seq.to(tl.int64) * (tl.num_programs(1) * GROUP) + heads
            tl.store(lse_ptr + lse_row * NUM_SPLITS + split, lse, mask=g_mask)

    @triton.jit
    def _merge_splits_kernel(
        part_ptr,  # [n, H, S, D] float32
        lse_ptr,  # [n, H, S] float32, base-2 log-sum-exp per split
        out_ptr,  # [n, H, D]
        stride_out_seq,
        stride_out_head,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
    ):
        seq = tl.program_id(0)
        head = tl.program_id(1)
        num_heads = tl.num_programs(1)
        offs_s = tl.arange(0, NUM_SPLITS)
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        row = seq.to(tl.int64) * num_heads + head
        lse = tl.load(lse_ptr + row * NUM_SPLITS + offs_s)
        m = tl.max(lse, 0)
        w = tl.where(lse > float("-inf"), tl.math.exp2(lse - m), 0.0)
        total = tl.sum(w, 0)
        w = w / tl.where(total > 0, total, 1.0)
        part = tl.load(
            part_ptr + (row * NUM_SPLITS + offs_s[:, None]) * HEAD_DIM + offs_d[None, :],
            mask=d_mask[None, :],
            other=0.0,
        )
        out = tl.sum(part * w[:, None], 0)
        tl.store(
            out_ptr + seq.to(tl.int64) * stride_out_seq + head * stride_out_head + offs_d,
            out.to(out_ptr.dtype.element_ty),
            mask=d_mask,
        )

    @triton.jit
    def _write_kv_kernel(
        key_ptr,  # [T, KVH, D], any strides over T and KVH
        value_ptr,
        rows_ptr,  # the cache viewed as rows of KVH * D
        slot_rows_ptr,  # [T] int64: layer 0's K row of each token
        layer_offset,  # this layer's first row past layer 0's
        v_offset,  # rows from a K row to its V row (the block size)
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        NUM_KV_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        t = tl.program_id(0)
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
        row = tl.load(slot_rows_ptr + t) + layer_offset
        dst = offs_h[:, None] * HEAD_DIM + offs_d[None, :]
        k = tl.load(key_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask)
        v = tl.load(value_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask)
        row_len = NUM_KV_HEADS * HEAD_DIM
        tl.store(rows_ptr + row * row_len + dst, k.to(rows_ptr.dtype.element_ty), mask)
        tl.store(rows_ptr + (row + v_offset) * row_len + dst, v.to(rows_ptr.dtype.element_ty), mask)


def write_kv_rows(
    rows: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_rows: torch.Tensor,
    layer_offset: int,
    v_offset: int,
) -> None:
    """K and V of each token [T, KVH, D] into cache rows `slot_rows + layer_offset` and
    `+ v_offset`, in one launch: `index_copy_` took two, plus two for the row indices."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if key.stride(2) != 1 or value.stride(2) != 1:
        key, value = key.contiguous(), value.contiguous()
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        rows,
        slot_rows,
        layer_offset,
        v_offset,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=1 if num_kv_heads * head_dim <= 512 else 4,
    )


def paged_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    layer_idx: int,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int,
    out: torch.Tensor | None = None,
    new_key: torch.Tensor | None = None,
    new_value: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context.

    query [n, H, D]; kv_cache [num_blocks, L, 2, block_size, KVH, D]; block_table
    [n, max_blocks] (int32 or int64); context_lens [n] (tokens in the cache, the query's
    own K/V included; 0 gives a zero output). Returns (or fills) out [n, H, D].
    With `new_key` and `new_value` ([n, KVH, D] each), they are each sequence's newest
    K/V (position context_lens - 1), not yet in the cache: the kernel attends to them
    from the inputs and stores them into that position of layer `layer_idx`, a decode
    step's K/V write and attention in one launch.
    """
    if triton is None:
        raise RuntimeError("paged_decode_attention needs triton")
    n, num_heads, head_dim = query.shape
    _, _, _, block_size, num_kv_heads, cache_head_dim = kv_cache.shape
    if cache_head_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(
            f"query [{n}, {num_heads}, {head_dim}] does not fit a cache of "
            f"{num_kv_heads} kv heads of dim {cache_head_dim}"
        )
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    if query.stride(2) != 1 or kv_cache.stride(5) != 1 or block_table.stride(1) != 1:
        raise ValueError("query, kv_cache and block_table need a contiguous last dim")
    if (new_key is None) != (new_value is None):
        raise ValueError("new_key and new_value come together")
    if new_key is not None and new_value is not None:
        if new_key.shape != (n, num_kv_heads, head_dim) or new_value.shape != new_key.shape:
            raise ValueError(
                f"new_key/new_value must be [{n}, {num_kv_heads}, {head_dim}], got "
                f"{list(new_key.shape)} and {list(new_value.shape)}"
            )
        if new_key.stride(2) != 1 or new_value.stride(2) != 1:
            new_key, new_value = new_key.contiguous(), new_value.contiguous()
    if out is None:
        out = torch.empty_like(query)
    if n == 0:
        return out
    group = num_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    common = dict(
        BLOCK_SIZE=block_size,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_N=_BLOCK_N,
        NUM_SPLITS=num_splits,
        IEEE=query.dtype == torch.float32,
        num_warps=4,
        num_stages=2,
    )
    grid = (n, num_kv_heads, num_splits)
    kv_args = (
        layer_idx * kv_cache.stride(1),
        query.stride(0),
        query.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(2),
        kv_cache.stride(3),
        kv_cache.stride(4),
        block_table.stride(0),
    )
    qk_scale = scale * 1.4426950408889634  # log2(e): the kernel uses exp2
    write_new = new_key is not None
    new_k = new_key if new_key is not None else query  # unread placeholders otherwise
    new_v = new_value if new_value is not None else query
    new_strides = (new_k.stride(0), new_k.stride(1), new_v.stride(0), new_v.stride(1))
    if num_splits == 1:
        _decode_split_kernel[grid](
            query,
            kv_cache,
            block_table,
            context_lens,
            out,
            out,
            new_k,
            new_v,
            *kv_args,
            out.stride(0),
            out.stride(1),
            0,
            *new_strides,
            qk_scale,
            WRITE_NEW=write_new,
            **common,
        )
        return out
    part = torch.empty(
        (n, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device
    )
    lse = torch.empty((n, num_heads, num_splits), dtype=torch.float32, device=query.device)
    _decode_split_kernel[grid](
        query,
        kv_cache,
        block_table,
        context_lens,
        part,
        lse,
        new_k,
        new_v,
        *kv_args,
        part.stride(0),
        part.stride(1),
        part.stride(2),
        *new_strides,
        qk_scale,
        WRITE_NEW=write_new,
        **common,
    )
    _merge_splits_kernel[(n, num_heads)](
        part,
        lse,
        out,
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        NUM_SPLITS=num_splits,
        num_warps=4,
    )
    return out
