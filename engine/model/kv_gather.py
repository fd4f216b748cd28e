"""How a padded SDPA attention group reads its K/V from the paged cache: row by row (any
device: `kv_rows` index every token's K and V rows), or by whole blocks (CPU: one block's
K, or V, of one layer is `block_size` contiguous rows, one copy where rows take one per
token), with the mask each way needs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockGather:
    """SDPA groups gather whole blocks (CPU): how their padding reads and their masks."""

    zero_block: int  # a block past the cache that nothing writes: the padding blocks' K/V
    mask_dtype: torch.dtype  # the model's: masks are additive (0 attend, -inf not)


def row_gather(
    table: torch.Tensor,
    context_len: torch.Tensor,
    q_pos: torch.Tensor,
    max_kv: int,
    block_size: int,
    rows_per_block: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`kv_rows` [n, max_kv, 2] and the bool mask [n, 1, max_q, max_kv] of a group."""
    device = table.device
    kv_pos = torch.arange(max_kv, device=device)
    kv_valid = kv_pos[None, :] < context_len[:, None]  # [n, max_kv]
    # Padding reads position 0 of the same sequence, a slot it always owns and has
    # written: never a foreign or uninitialised slot (which could hold NaN/inf).
    kv_pos_safe = torch.where(kv_valid, kv_pos[None, :], 0)
    seq = torch.arange(table.shape[0], device=device)[:, None]
    kv_block = table[seq, kv_pos_safe // block_size]
    mask = (kv_pos[None, None, :] <= q_pos[:, :, None]) & kv_valid[:, None, :]
    k_rows = kv_block * rows_per_block + kv_pos_safe % block_size
    return torch.stack((k_rows, k_rows + block_size), dim=-1), mask[:, None, :, :]


def block_gather_of(
    tables: Sequence[Sequence[int]],
    contexts: Sequence[int],
    q_pos: torch.Tensor | None,
    max_kv: int,
    block_size: int,
    rows_per_block: int,
    gather: BlockGather,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`kv_blocks` [n, 2, max_blocks], `kv_tail` and the additive mask
    [n, 1, max_q, max_kv] of a group (CPU: the block rows are listed on the host, a few
    hundred at most, in less time than tensor ops take). `q_pos` [n, max_q]: each query
    row's position; None for a decode group (one query a sequence, at its last position).

    Attention reads the first `max_kv` positions of the gathered blocks. No slot a
    sequence has not written among them reaches SDPA: a stale or uninitialised one could
    hold NaN or inf, which a mask does not cancel (its weight 0 times NaN is NaN). So
    padding blocks read the zero block, and each gather zeroes its rows of `kv_tail`,
    the slots of a sequence's last block past its context. A decode group whose
    sequences all attend `max_kv` positions has neither tail nor mask (None).
    """
    num_blocks = -(-max_kv // block_size)
    width = num_blocks * block_size
    # Block row of (block b, layer l, k/v c) in the [-1, block_size * KVH * D] view.
    per_block = rows_per_block // block_size
    block_rows: list[list[int]] = []
    tail: list[int] = []
    for i, (table, context) in enumerate(zip(tables, contexts, strict=True)):
        own = -(-context // block_size)
        padding = [gather.zero_block * per_block] * (num_blocks - own)
        block_rows.append([b * per_block for b in table[:own]] + padding)
        # Only the slots attention reads: past `max_kv` nothing is looked at.
        tail.extend(range(i * 2 * width + context, i * 2 * width + min(own * block_size, max_kv)))
    first = torch.tensor(block_rows, dtype=torch.long)
    k_tail = torch.tensor(tail, dtype=torch.long)
    kv_blocks = torch.stack((first, first + 1), dim=1)
    kv_tail = torch.cat((k_tail, k_tail + width))
    if q_pos is None:
        if all(c == max_kv for c in contexts):
            return kv_blocks, kv_tail, None
        q_pos = torch.tensor(contexts, dtype=torch.long)[:, None] - 1
    kv_pos = torch.arange(max_kv)
    # A query row sees the positions up to its own (a padded row's is 0: one slot).
    allowed = kv_pos <= q_pos[:, :, None]
    mask = torch.full((len(tables), 1, *allowed.shape[1:]), float("-inf"), dtype=gather.mask_dtype)
    return kv_blocks, kv_tail, mask.masked_fill_(allowed[:, None], 0.0)
