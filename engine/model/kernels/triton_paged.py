"""What the paged attention kernels share: the KV-tile rows and the online-softmax step.

The decode kernel (`engine.model.kernels.triton_attention`) and the varlen kernel
(`engine.model.kernels.triton_prefill`) read K/V through the same block tables, in the same
cache layout `[num_blocks, num_layers, 2, block_size, KVH, D]` that a KV hand-off
moves block by block, and fold each tile into the same online softmax. Both take
these helpers, which Triton inlines into each kernel: one place says where a token's
K row lives, and one how a tile updates the running max, sum and output.
"""

from __future__ import annotations

try:  # Triton ships with CUDA builds of torch; the CPU path never needs it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]


if triton is not None:

    @triton.jit
    def kv_row(
        block,
        pos,
        kv_layer_offset,
        kv_head,
        stride_kv_block,
        stride_kv_tok,
        stride_kv_head,
        BLOCK_SIZE: tl.constexpr,
    ):
        """Element offset of the K row of `kv_head` at position `pos`, which lives in
        cache block `block` (int64), of the layer at `kv_layer_offset`; V is
        `stride_kv_kv` further."""
        return (
            block * stride_kv_block
            + kv_layer_offset
            + (pos % BLOCK_SIZE) * stride_kv_tok
            + kv_head * stride_kv_head
        )

    @triton.jit
    def dot(a, b, IEEE: tl.constexpr):
        """`tl.dot`, exact for float32 inputs (IEEE) instead of tf32."""
        if IEEE:  # noqa: SIM108 (a constexpr branch, resolved at compile time)
            out = tl.dot(a, b, input_precision="ieee")
        else:
            out = tl.dot(a, b)
        return out

    @triton.jit
    def attend_tile(
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
        BLOCK_SIZE: tl.constexpr,
        IEEE: tl.constexpr,
        CAUSAL: tl.constexpr,
        SAFE_MAX: tl.constexpr,
    ):
        """Fold one tile of context positions `pos` (the `valid` ones real) into the online
        softmax of the query rows `q`: returns the new running max, sum and unnormalised
        output.

        Each position's block comes from the sequence's block-table row `table_row`
        (positions not valid read block 0, masked out). Scores are base 2 (`qk_scale`
        includes log2(e)). `CAUSAL`: a query row at position `q_pos` sees positions up
        to its own (else every valid one). `SAFE_MAX`: a row may have seen no score yet
        after this tile (its max still -inf); exponents are then taken against 0 so they
        stay finite.
        """
        block = tl.load(table_row + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        rows = kv_row(
            block,
            pos,
            kv_layer_offset,
            kv_head,
            stride_kv_block,
            stride_kv_tok,
            stride_kv_head,
            BLOCK_SIZE,
        )
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(kv_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        qk = dot(q, tl.trans(k), IEEE)
        if CAUSAL:  # noqa: SIM108 (a constexpr branch, resolved at compile time)
            score_mask = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        else:
            score_mask = valid[None, :]
        qk = tl.where(score_mask, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_exp = m_new
        if SAFE_MAX:
            m_exp = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_exp)
        p = tl.math.exp2(qk - m_exp[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            kv_ptr + stride_kv_kv + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0
        )
        pv = dot(p.to(v.dtype), v, IEEE)
        acc = acc * alpha[:, None] + pv
        return m_new, l_i, acc
