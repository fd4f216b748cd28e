"""Paged varlen attention in Triton: packed chunks of any length, no padding.

Every sequence of a step (prefill chunks, recompute chunks and single decode tokens
alike) is one run of consecutive rows in the packed query `[T, H, D]`. Program
(seq, tile, kv_head) takes up to `BLOCK_M // GROUP` of the sequence's query tokens
times the GROUP query heads that share `kv_head` (one `tl.dot` tile, so GQA reads
each K/V tile once), then walks the sequence's context through its block table: the
cached prefix, earlier chunks and this chunk's own K/V (written before the call), with
a causal mask on positions. Output rows land straight in `out[T, H, D]`: no gather,
no scatter, one launch for a whole mixed step.

Cache layout (engine.model.attention): `[num_blocks, num_layers, 2, block_size, KVH, D]`.
"""

from __future__ import annotations

import torch

from engine.model.kernels.triton_paged import tl, triton

if triton is not None:
    from engine.model.kernels.triton_paged import attend_tile

_BLOCK_M = 64  # query rows (tokens x heads of one kv head) per program
_BLOCK_N = 64  # context tokens per inner tile

if triton is not None:

    @triton.jit
    def _varlen_kernel(
        q_ptr,
        kv_ptr,
        table_ptr,
        q_start_ptr,  # [n] packed index of each sequence's first query token
        q_len_ptr,  # [n] query tokens of each sequence this step
        pos_ptr,  # [n] position of that first token (= tokens cached before it)
        out_ptr,
        kv_layer_offset,
        stride_q_tok,
        stride_q_head,
        stride_kv_block,
        stride_kv_kv,
        stride_kv_tok,
        stride_kv_head,
        stride_table_seq,
        stride_out_tok,
        stride_out_head,
        qk_scale,  # softmax scale * log2(e)
        BLOCK_SIZE: tl.constexpr,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        seq = tl.program_id(0)
        tile = tl.program_id(1)
        kv_head = tl.program_id(2)
        TOKENS: tl.constexpr = BLOCK_M // GROUP
        q_len = tl.load(q_len_ptr + seq).to(tl.int32)
        first = tile * TOKENS
        if first < q_len:
            q0 = tl.load(q_start_ptr + seq).to(tl.int64)
            pos0 = tl.load(pos_ptr + seq).to(tl.int32)
            offs_m = tl.arange(0, BLOCK_M)
            offs_d = tl.arange(0, BLOCK_D)
            d_mask = offs_d < HEAD_DIM
            tok = first + offs_m // GROUP
            head = kv_head * GROUP + offs_m % GROUP
            row_ok = (offs_m < TOKENS * GROUP) & (tok < q_len)
            # Rows past the chunk keep a real position (>= pos0): they attend to
            # position 0 at least, so no row's softmax is empty (no NaN).
            q_pos = pos0 + tok
            q_rows = (q0 + tok).to(tl.int64)
            q = tl.load(
                q_ptr
                + q_rows[:, None] * stride_q_tok
                + head[:, None] * stride_q_head
                + offs_d[None, :],
                mask=row_ok[:, None] & d_mask[None, :],
                other=0.0,
            )
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
            table_row = table_ptr + seq.to(tl.int64) * stride_table_seq
            # The tile's last query sees positions < end; nothing later is read.
            end = pos0 + tl.minimum(first + TOKENS, q_len)
            for kv0 in range(0, end, BLOCK_N):
                pos = kv0 + tl.arange(0, BLOCK_N)
                valid = pos < end
                m_i, l_i, acc = attend_tile(
                    q,
                    m_i,
                    l_i,
                    acc,
                    kv_ptr,
                    table_row,
                    pos,
                    valid,
                    q_pos,
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
                    True,
                    False,
                )
            out = acc / l_i[:, None]
            tl.store(
                out_ptr
                + q_rows[:, None] * stride_out_tok
                + head[:, None] * stride_out_head
                + offs_d[None, :],
                out.to(out_ptr.dtype.element_ty),
                mask=row_ok[:, None] & d_mask[None, :],
            )


def paged_varlen_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    layer_idx: int,
    block_table: torch.Tensor,
    q_starts: torch.Tensor,
    q_lens: torch.Tensor,
    positions: torch.Tensor,
    max_q: int,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed query chunks over their paged contexts.

    query [T, H, D] (sequence i owns rows q_starts[i] : q_starts[i] + q_lens[i]);
    kv_cache [num_blocks, L, 2, block_size, KVH, D] already holding this step's K/V;
    block_table [n, max_blocks]; positions [n] position of each chunk's first token;
    max_q >= every q_lens[i] (sizes the grid). Returns (or fills) out [T, H, D];
    rows that belong to no sequence are left untouched.
    """
    if triton is None:
        raise RuntimeError("paged_varlen_attention needs triton")
    num_tokens, num_heads, head_dim = query.shape
    _, _, _, block_size, num_kv_heads, cache_head_dim = kv_cache.shape
    if cache_head_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(
            f"query [{num_tokens}, {num_heads}, {head_dim}] does not fit a cache of "
            f"{num_kv_heads} kv heads of dim {cache_head_dim}"
        )
    if query.stride(2) != 1 or kv_cache.stride(5) != 1 or block_table.stride(1) != 1:
        raise ValueError("query, kv_cache and block_table need a contiguous last dim")
    group = num_heads // num_kv_heads
    if group > _BLOCK_M:
        raise ValueError(f"{group} query heads per kv head exceed a tile of {_BLOCK_M} rows")
    if out is None:
        out = torch.empty_like(query)
    n = block_table.shape[0]
    if n == 0 or max_q < 1:
        return out
    tokens_per_tile = _BLOCK_M // group
    grid = (n, triton.cdiv(max_q, tokens_per_tile), num_kv_heads)
    _varlen_kernel[grid](
        query,
        kv_cache,
        block_table,
        q_starts,
        q_lens,
        positions,
        out,
        layer_idx * kv_cache.stride(1),
        query.stride(0),
        query.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(2),
        kv_cache.stride(3),
        kv_cache.stride(4),
        block_table.stride(0),
        out.stride(0),
        out.stride(1),
        scale * 1.4426950408889634,  # log2(e): the kernel uses exp2
        BLOCK_SIZE=block_size,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_M=_BLOCK_M,
        BLOCK_N=_BLOCK_N,
        IEEE=query.dtype == torch.float32,
        num_warps=4,
        num_stages=2,
    )
    return out
