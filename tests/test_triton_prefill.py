"""The Triton paged varlen attention kernel against a float64 reference.

Runs on CUDA (`pytest -m gpu`), or on CPU through Triton's interpreter when Triton is
installed and `TRITON_INTERPRET=1` is set before the run. Covers cached prefixes, a
prompt run as several chunks (each reading the earlier ones through the block table),
ragged chunk lengths across tile boundaries, single decode tokens in the same launch,
GQA groups of 1, 3 and 4, and shuffled block tables.
"""

from __future__ import annotations

import os
import random
from typing import Any

import pytest
import torch

from engine.model.kernels.triton_attention import triton_available

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not triton_available() or not (torch.cuda.is_available() or _INTERPRET),
        reason="needs triton and CUDA (or TRITON_INTERPRET=1 on CPU)",
    ),
]

if _INTERPRET and triton_available():
    # Triton 3.6's interpreter turns a loaded scalar into a loop bound with
    # int(one-element array), which numpy >= 2.4 refuses; take the element instead.
    from triton.runtime import interpreter as _interpreter

    _patch_tensor = _interpreter._patch_lang_tensor

    def _patch_lang_tensor(tensor: object, scope: Any) -> None:  # an interpreter's scope
        _patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _interpreter._patch_lang_tensor = _patch_lang_tensor

NUM_LAYERS = 2
LAYER = 1
BLOCK_SIZE = 16


def reference(
    query: torch.Tensor,
    cache: torch.Tensor,
    tables: list[list[int]],
    q_lens: list[int],
    positions: list[int],
    scale: float,
) -> torch.Tensor:
    """Float64 causal attention of each chunk over its context, read from the cache."""
    num_heads = query.shape[1]
    num_kv_heads = cache.shape[4]
    out = torch.zeros_like(query, dtype=torch.float64)
    row = 0
    for table, q_len, pos0 in zip(tables, q_lens, positions, strict=True):
        ctx = pos0 + q_len
        pos = torch.arange(ctx)
        blocks = torch.tensor(table)[pos // BLOCK_SIZE]
        k = cache[blocks, LAYER, 0, pos % BLOCK_SIZE].double()  # [ctx, KVH, D]
        v = cache[blocks, LAYER, 1, pos % BLOCK_SIZE].double()
        group = num_heads // num_kv_heads
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, ctx, D]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        q = query[row : row + q_len].double().transpose(0, 1)  # [H, q, D]
        scores = q @ k.transpose(1, 2) * scale
        q_pos = pos0 + torch.arange(q_len)
        scores = scores.masked_fill(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[row : row + q_len] = (scores.softmax(-1) @ v).transpose(0, 1)
        row += q_len
    return out


def run_kernel(
    query: torch.Tensor,
    cache: torch.Tensor,
    tables: list[list[int]],
    q_lens: list[int],
    positions: list[int],
    scale: float,
) -> torch.Tensor:
    from engine.model.kernels.triton_prefill import paged_varlen_attention

    width = max(len(t) for t in tables)
    table = torch.zeros((len(tables), width), dtype=torch.int32)
    for i, t in enumerate(tables):
        table[i, : len(t)] = torch.tensor(t)
    starts = [sum(q_lens[:i]) for i in range(len(q_lens))]

    def ints(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=DEVICE)

    out = torch.full_like(query, float("nan"))
    return paged_varlen_attention(
        query,
        cache,
        LAYER,
        table.to(DEVICE),
        ints(starts),
        ints(q_lens),
        ints(positions),
        max(q_lens),
        scale,
        out=out,
    )


def random_case(
    rng: random.Random,
    q_lens: list[int],
    positions: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    need = [-(-(p + q) // BLOCK_SIZE) for p, q in zip(positions, q_lens, strict=True)]
    num_blocks = sum(need) + 3
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables = []
    for n in need:
        tables.append(ids[:n])
        ids = ids[n:]
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    shape = (num_blocks, NUM_LAYERS, 2, BLOCK_SIZE, num_kv_heads, head_dim)
    cache = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    query = torch.randn((sum(q_lens), num_heads, head_dim), generator=gen).to(dtype).to(DEVICE)
    return query, cache, tables


CASES = [
    # (q_lens, positions): cached prefixes, ragged chunks, decode tokens in one launch
    ([7], [0]),
    ([33, 1, 70, 5], [0, 40, 16, 3]),
    ([1, 1, 1], [0, 15, 100]),
    ([130, 17], [48, 0]),
]


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 2)])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_varlen_matches_float64_reference(num_heads: int, num_kv_heads: int, case: int) -> None:
    q_lens, positions = CASES[case]
    rng = random.Random(case * 100 + num_heads)
    head_dim = 32 if num_heads == 9 else 64
    query, cache, tables = random_case(
        rng, q_lens, positions, num_heads, num_kv_heads, head_dim, torch.float32
    )
    scale = head_dim**-0.5
    out = run_kernel(query, cache, tables, q_lens, positions, scale)
    ref = reference(query.cpu(), cache.cpu(), tables, q_lens, positions, scale)
    assert torch.isfinite(out).all()
    assert (out.cpu().double() - ref).abs().max().item() < 1e-4


def test_chunks_read_earlier_chunks_through_the_block_table() -> None:
    # One 90-token prompt as chunks of 40, 35 and 15 after a 32-token cached prefix: each
    # call sees only its own rows, yet attends to everything written before it.
    rng = random.Random(7)
    num_heads, num_kv_heads, head_dim = 8, 2, 64
    total, prefix = 122, 32
    query, cache, tables = random_case(
        rng, [total - prefix], [prefix], num_heads, num_kv_heads, head_dim, torch.float32
    )
    scale = head_dim**-0.5
    whole = reference(query.cpu(), cache.cpu(), tables, [total - prefix], [prefix], scale)
    row = 0
    for chunk in (40, 35, 15):
        part = run_kernel(
            query[row : row + chunk].contiguous(), cache, tables, [chunk], [prefix + row], scale
        )
        err = (part.cpu().double() - whole[row : row + chunk]).abs().max().item()
        assert err < 1e-4, (chunk, err)
        row += chunk


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 tensor cores: CUDA only")
def test_varlen_bf16_close_to_reference() -> None:
    rng = random.Random(3)
    q_lens, positions = [300, 1, 64, 9], [200, 511, 0, 31]
    query, cache, tables = random_case(rng, q_lens, positions, 32, 8, 128, torch.bfloat16)
    scale = 128**-0.5
    out = run_kernel(query, cache, tables, q_lens, positions, scale)
    ref = reference(query.cpu(), cache.cpu(), tables, q_lens, positions, scale)
    err = ((out.cpu().double() - ref).norm() / ref.norm()).item()
    assert err < 1e-2, err
