"""One step's attention inputs, built once per step and shared by every layer.

`PagedAttentionMetadata.build` turns the scheduler's batch into index tensors with
tensor ops on the target device: the cache row of each new token's K/V, and the
attention groups. The forward pass then has no per-request Python loop and no host
sync. Rows address the cache as in `engine.model.attention`: one token's K (or V) of
one layer is one row of `kv_cache.view(-1, KVH * D)`.

* On CUDA (with Triton) a pure-decode step is one paged group (the split-K kernel walks
  the block tables), and a step with any prompt chunk is one `VarlenGroup` (the varlen
  kernel, every sequence in one launch): nothing is gathered or padded.
* Elsewhere sequences form decode groups (one query token each) and a prefill
  group, each a padded, masked batch of gathered K/V. Decodes of very different
  context lengths form two groups, so a short sequence does not pay for the longest
  one's padding. On CPU a group gathers whole blocks (`BlockGather`: one block's K, or
  V, of one layer is `block_size` contiguous rows, one copy where gathering by rows
  takes one per token) and carries its mask as the additive float mask SDPA would
  otherwise rebuild from a bool one in every layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.core.batch import Batch
from engine.model.kernels.triton_attention import triton_available
from engine.model.kv_gather import BlockGather, block_gather_of, row_gather
from engine.model.staging import to_device


@dataclass(frozen=True)
class AttentionGroup:
    """Padded index tensors for `n` sequences attending as one batch.

    A group with `kv_rows` (or, on CPU, `kv_blocks`) and `mask` runs as one batched
    SDPA over gathered K/V; one without (`paged` True: decode groups on CUDA) runs the
    Triton paged kernel.
    """

    q_index: torch.Tensor  # [n, max_q] packed-token index; padding repeats a valid token
    kv_rows: torch.Tensor | None  # [n, max_kv, 2] cache rows of layer 0's K, V per kv position
    block_table: torch.Tensor  # [n, max_blocks] for kernels that walk blocks themselves
    context_lens: torch.Tensor  # [n] tokens in the cache after this step's writes
    # [n, 1, max_q, max_kv], True = attend; with `kv_blocks` float, 0 = attend, -inf not
    # (None: a decode group whose sequences all attend max_kv positions).
    mask: torch.Tensor | None
    out_rows: torch.Tensor  # [m] rows of the flattened [n * max_q] output that are real
    out_tokens: torch.Tensor  # [m] packed-token index each real row belongs to
    # A bound on context_lens (sizes the paged kernel's split count); with `kv_blocks`,
    # the positions of the gathered blocks attention reads (max_kv).
    max_context: int = 0
    identity: bool = False  # token i is sequence i, all real: no gather/scatter needed
    # [n, 2, max_blocks] block rows (`kv_cache.view(-1, block_size * KVH * D)`) of layer
    # 0's K and V of each sequence's blocks (CPU, instead of `kv_rows`): layer l's are
    # these + 2 * l.
    kv_blocks: torch.Tensor | None = None
    # With `kv_blocks`: the gathered rows ([n * 2 * max_kv] of K/V) past a sequence's
    # context in its last block, zeroed after each gather.
    kv_tail: torch.Tensor | None = None

    @property
    def paged(self) -> bool:
        """True when the Triton kernel walks the block tables (no gathered rows)."""
        return self.kv_rows is None and self.kv_blocks is None


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
    # CPU: `slot_rows`, then `slot_rows + block_size`: the K rows, then the V rows, of
    # layer 0, so that a layer writes its K and V in one copy.
    kv_slot_rows: torch.Tensor | None = None

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
        block_gather: BlockGather | None = None,
    ) -> PagedAttentionMetadata:
        """Index tensors for one step of `batch` (sequences packed in batch order).

        `paged_decode` (None: on CUDA when Triton imports) runs attention in the Triton
        kernels instead of SDPA. `block_gather`: SDPA groups gather whole blocks.
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
            block_gather=block_gather,
        )


def bucket_size(n: int, granule: int) -> int:
    """Round n up to a power of two below `granule`, else to a multiple of `granule`."""
    if n <= granule:
        return 1 << max(n - 1, 0).bit_length()
    return -(-n // granule) * granule


# cuDNN's SDPA (what torch picks on CUDA for a masked GQA call) builds an execution
# graph for every new shape, tens of ms of host time, then caches it. Group
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
    block_gather: BlockGather | None = None,
) -> PagedAttentionMetadata:
    """Metadata from plain lists: per-sequence query counts, start positions and block
    tables. `block_gather`: SDPA groups gather whole blocks."""
    n = len(num_q)
    if block_gather is not None and 0 < n == sum(num_q) and not bucket_shapes and not paged_decode:
        return _host_decode_metadata(
            start_positions, block_tables, block_size, num_layers, block_gather
        )
    return _tensor_metadata(
        num_q,
        start_positions,
        block_tables,
        block_size,
        num_layers,
        device,
        bucket_shapes,
        paged_decode,
        block_gather,
    )


def _tensor_metadata(
    num_q: Sequence[int],
    start_positions: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    num_layers: int,
    device: torch.device,
    bucket_shapes: bool,
    paged_decode: bool,
    block_gather: BlockGather | None,
) -> PagedAttentionMetadata:
    """`build_metadata` with tensor ops on the device: any step."""
    n = len(num_q)
    num_tokens = sum(num_q)
    seqs = _seq_tensors(num_q, start_positions, block_tables, device)
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
    groups: tuple[AttentionGroup | VarlenGroup, ...]
    if paged_decode and max_q > 1:
        varlen = VarlenGroup(
            block_table=seqs.table,
            q_starts=seqs.q_start,
            q_lens=seqs.num_q,
            positions=seqs.start,
            max_q=max_q,
        )
        groups = (varlen,)
    else:
        groups = tuple(
            _padded_groups(
                num_q,
                start_positions,
                seqs,
                block_size,
                rows_per_block,
                bucket_shapes,
                paged_decode,
                block_tables,
                block_gather,
            )
        )
    return PagedAttentionMetadata(
        positions=positions,
        slot_rows=slot_rows,
        rows_per_layer=2 * block_size,
        block_size=block_size,
        groups=groups,
        kv_slot_rows=(
            None if block_gather is None else torch.cat((slot_rows, slot_rows + block_size))
        ),
    )


def _host_decode_metadata(
    start_positions: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    num_layers: int,
    block_gather: BlockGather,
) -> PagedAttentionMetadata:
    """`build_metadata` of a step of decodes alone (one token a sequence) on CPU, the
    same tensors computed on the host: a handful of small lists where the general path
    runs dozens of tensor ops, each costing more than the list it stands for."""
    n = len(start_positions)
    rows_per_block = num_layers * 2 * block_size
    slot_rows = [
        table[p // block_size] * rows_per_block + p % block_size
        for p, table in zip(start_positions, block_tables, strict=True)
    ]
    max_blocks = max((len(t) for t in block_tables), default=1)
    groups = []
    for ids in _split_by_context(list(range(n)), start_positions):
        contexts = [start_positions[i] + 1 for i in ids]
        tables = [block_tables[i] for i in ids]
        kv_blocks, kv_tail, mask = block_gather_of(
            tables, contexts, None, max(contexts), block_size, rows_per_block, block_gather
        )
        seq = torch.tensor(ids, dtype=torch.long)
        padded = [[*t, *[0] * (max_blocks - len(t))] for t in tables]
        groups.append(
            AttentionGroup(
                q_index=seq[:, None],
                kv_rows=None,
                block_table=torch.tensor(padded, dtype=torch.long).view(len(ids), max_blocks),
                context_lens=torch.tensor(contexts, dtype=torch.long),
                mask=mask,
                out_rows=torch.arange(len(ids)),
                out_tokens=seq,
                max_context=max(contexts),
                identity=len(ids) == n,
                kv_blocks=kv_blocks,
                kv_tail=kv_tail,
            )
        )
    slots = torch.tensor(slot_rows, dtype=torch.long)
    kv_slot_rows = torch.cat((slots, slots + block_size))
    return PagedAttentionMetadata(
        positions=torch.tensor(start_positions, dtype=torch.long),
        slot_rows=slots,
        rows_per_layer=2 * block_size,
        block_size=block_size,
        groups=tuple(groups),
        kv_slot_rows=kv_slot_rows,
    )


def _seq_tensors(
    num_q: Sequence[int],
    start_positions: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    device: torch.device,
) -> _SeqTensors:
    """The step's per-sequence facts on the device. Small per-sequence tensors travel to
    the device; everything per token is derived there, so the host does
    O(num_seqs + num_blocks) work per step."""
    n = len(num_q)
    q_start = [0] * n
    for i in range(1, n):
        q_start[i] = q_start[i - 1] + num_q[i - 1]
    max_blocks = max((len(t) for t in block_tables), default=1)
    padded = [[*t, *[0] * (max_blocks - len(t))] for t in block_tables]
    table = torch.tensor(padded, dtype=torch.long).view(n, max_blocks)
    return _SeqTensors(
        num_q=to_device(num_q, torch.long, device),
        q_start=to_device(q_start, torch.long, device),
        start=to_device(start_positions, torch.long, device),
        table=to_device(table, torch.long, device),
    )


def _padded_groups(
    num_q: Sequence[int],
    start_positions: Sequence[int],
    seqs: _SeqTensors,
    block_size: int,
    rows_per_block: int,
    bucket_shapes: bool,
    paged_decode: bool,
    block_tables: Sequence[Sequence[int]],
    block_gather: BlockGather | None,
) -> list[AttentionGroup]:
    """The step's attention groups, decode groups first, then prefill (empty ones left
    out): padded batches of gathered rows (whole blocks with `block_gather`), or on CUDA
    one paged decode group."""
    n = len(num_q)
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
                block_gather=None if paged else block_gather,
                tables=[block_tables[i] for i in ids],
            )
        )
    return groups


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
    block_gather: BlockGather | None = None,
    tables: Sequence[Sequence[int]] = (),
) -> AttentionGroup:
    """Padded index tensors for the sequences `ids` (the first `num_real` are real).

    `paged`: for the Triton kernel, which needs no gathered rows and no mask.
    `block_gather`: K/V gathered by whole blocks (`kv_blocks`) of `tables`, the block
    tables of `ids`.
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
    kv_rows = kv_blocks = kv_tail = mask = None
    if block_gather is not None:
        kv_blocks, kv_tail, mask = block_gather_of(
            tables,
            context_len.tolist(),
            q_pos if max_q > 1 else None,
            max_kv,
            block_size,
            rows_per_block,
            block_gather,
        )
    elif not paged:
        kv_rows, mask = row_gather(g_table, context_len, q_pos, max_kv, block_size, rows_per_block)
    return AttentionGroup(
        q_index=q_index,
        kv_rows=kv_rows,
        block_table=g_table,
        context_lens=context_len,
        mask=mask,
        out_rows=row_seq * max_q + row_within,
        out_tokens=g_q_start[row_seq] + row_within,
        max_context=max_kv,
        identity=identity,
        kv_blocks=kv_blocks,
        kv_tail=kv_tail,
    )
