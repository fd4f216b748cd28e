"""CPU attention: the host-built metadata of a decode step, and whole-block gathers (no
mask where every sequence attends the same context, one scratch buffer for every
gather of a step) against the row-by-row gather."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.model.attention import paged_attention, paged_step
from engine.model.attention_metadata import (
    AttentionGroup,
    PagedAttentionMetadata,
    _tensor_metadata,
    build_metadata,
)
from engine.model.kv_gather import BlockGather

LAYERS, BLOCK, KV_HEADS, HEADS, DIM = 2, 4, 2, 4, 8
NUM_BLOCKS = 40  # the last one is the zero block nothing writes
ZERO = BlockGather(zero_block=NUM_BLOCKS - 1, mask_dtype=torch.float32)
CPU = torch.device("cpu")


def _tables(contexts: list[int], extra: int = 1) -> list[list[int]]:
    """Disjoint, shuffled block tables with room for each context plus `extra` blocks."""
    need = [-(-c // BLOCK) + extra for c in contexts]
    ids = torch.randperm(NUM_BLOCKS - 1, generator=torch.Generator().manual_seed(1)).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(ids[at : at + n])
        at += n
    return tables


def _assert_same(a: object, b: object, where: str) -> None:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and torch.equal(a, b), where
    else:
        assert a == b, where


def _assert_same_metadata(fast: PagedAttentionMetadata, full: PagedAttentionMetadata) -> None:
    for f in dataclasses.fields(PagedAttentionMetadata):
        if f.name != "groups":
            _assert_same(getattr(fast, f.name), getattr(full, f.name), f.name)
    assert len(fast.groups) == len(full.groups)
    for g_fast, g_full in zip(fast.groups, full.groups, strict=True):
        assert isinstance(g_fast, AttentionGroup) and isinstance(g_full, AttentionGroup)
        for f in dataclasses.fields(AttentionGroup):
            _assert_same(getattr(g_fast, f.name), getattr(g_full, f.name), f.name)


@pytest.mark.parametrize(
    "contexts",
    [
        [9, 9, 9],  # one group, no mask, tails to zero
        [8, 8],  # contexts end on a block boundary: no tail
        [1],  # a lone first decode
        [30, 2, 29, 3],  # ragged: two groups, masks
        [7, 12, 9],  # ragged within one group
    ],
)
def test_host_decode_metadata_matches_the_tensor_path(contexts: list[int]) -> None:
    tables = _tables(contexts)
    starts = [c - 1 for c in contexts]
    args = ([1] * len(contexts), starts, tables, BLOCK, LAYERS, CPU)
    fast = build_metadata(*args, block_gather=ZERO)
    full = _tensor_metadata(*args, bucket_shapes=False, paged_decode=False, block_gather=ZERO)
    _assert_same_metadata(fast, full)
    first = fast.groups[0]
    assert isinstance(first, AttentionGroup)
    assert (first.mask is None) == (len(set(contexts)) == 1)


def _attend(
    kv: torch.Tensor,
    meta: PagedAttentionMetadata,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> list[torch.Tensor]:
    with paged_step(meta, kv):
        return [paged_attention(q, k, v, layer, DIM**-0.5) for layer in range(LAYERS)]


@pytest.mark.parametrize(
    ("num_q", "contexts"),
    [
        ([1, 1, 1], [9, 9, 9]),  # decodes of one context: gathered without a mask
        ([1, 1, 1, 1], [30, 2, 29, 3]),  # two decode groups
        ([1, 5, 1, 3], [13, 5, 2, 11]),  # decodes and prompt chunks share the scratch
    ],
)
def test_block_gather_matches_the_row_gather(num_q: list[int], contexts: list[int]) -> None:
    gen = torch.Generator().manual_seed(0)
    storage = torch.empty(NUM_BLOCKS, LAYERS, 2, BLOCK, KV_HEADS, DIM)
    tables = _tables(contexts)
    # Slots no sequence has written hold NaN: no gather may let one reach the output.
    storage[:] = float("nan")
    for table, context, n in zip(tables, contexts, num_q, strict=True):
        for pos in range(context - n):  # what earlier steps wrote
            storage[table[pos // BLOCK], :, :, pos % BLOCK].normal_(generator=gen)
    storage[ZERO.zero_block] = 0.0
    tokens = sum(num_q)
    q = torch.randn(tokens, HEADS, DIM, generator=gen)
    k = torch.randn(tokens, KV_HEADS, DIM, generator=gen)
    v = torch.randn(tokens, KV_HEADS, DIM, generator=gen)
    starts = [c - n for c, n in zip(contexts, num_q, strict=True)]
    by_blocks, by_rows = storage.clone(), storage.clone()
    blocks_meta = build_metadata(num_q, starts, tables, BLOCK, LAYERS, CPU, block_gather=ZERO)
    rows_meta = build_metadata(num_q, starts, tables, BLOCK, LAYERS, CPU)
    got = _attend(by_blocks, blocks_meta, q, k, v)
    want = _attend(by_rows, rows_meta, q, k, v)
    for layer_got, layer_want in zip(got, want, strict=True):
        assert torch.isfinite(layer_got).all()
        torch.testing.assert_close(layer_got, layer_want)
    # Both wrote the step's K/V to the same slots (NaN compared equal: untouched alike).
    assert torch.equal(by_blocks.isnan(), by_rows.isnan())
    assert torch.equal(by_blocks.nan_to_num(), by_rows.nan_to_num())
