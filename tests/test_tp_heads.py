"""KV heads per tensor-parallel rank, and the hand-off plan between groups of any sizes."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.parallel.tp_heads import (
    handoff_plan,
    kv_heads_of_rank,
    num_local_kv_heads,
    q_heads_of_rank,
    tp_size_problem,
)

SIZES = (1, 2, 4, 8)


def test_heads_split_evenly_then_replicate_by_the_loaders_rule() -> None:
    assert [kv_heads_of_rank(8, 2, r) for r in range(2)] == [range(0, 4), range(4, 8)]
    # 2 KV heads over 8 ranks: four consecutive ranks share a head (r // 4, not r % 2).
    assert [kv_heads_of_rank(2, 8, r).start for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert num_local_kv_heads(2, 8) == 1
    assert num_local_kv_heads(8, 2) == 4


@pytest.mark.parametrize(("num_q", "num_kv"), [(32, 8), (64, 8), (9, 3), (16, 2), (8, 1)])
@pytest.mark.parametrize("tp", SIZES + (3,))
def test_each_ranks_query_heads_read_the_kv_head_it_holds(num_q: int, num_kv: int, tp: int) -> None:
    if tp_size_problem(num_q, num_kv, tp):
        pytest.skip("this size cannot split the model")
    group = num_q // num_kv
    for rank in range(tp):
        kv = kv_heads_of_rank(num_kv, tp, rank)
        needed = {q // group for q in q_heads_of_rank(num_q, tp, rank)}
        assert needed <= set(kv), (rank, kv, needed)


def test_sizes_that_cannot_split_name_the_numbers() -> None:
    assert tp_size_problem(9, 3, 2) == (
        "tensor parallel size 2 does not divide the model's 9 attention heads"
    )
    assert "6 KV heads" in (tp_size_problem(24, 6, 4) or "")
    assert tp_size_problem(9, 3, 3) is None
    assert tp_size_problem(32, 8, 16) is None


@given(
    num_kv=st.sampled_from(SIZES),
    src_tp=st.sampled_from(SIZES),
    dst_tp=st.sampled_from(SIZES),
)
def test_every_decode_ranks_heads_come_once_from_a_rank_that_holds_them(
    num_kv: int, src_tp: int, dst_tp: int
) -> None:
    plan = handoff_plan(num_kv, src_tp, dst_tp)
    for dst in range(dst_tp):
        wanted = kv_heads_of_rank(num_kv, dst_tp, dst)
        received: list[int] = []
        for part in (p for p in plan if p.dst_rank == dst):
            held = kv_heads_of_rank(num_kv, src_tp, part.src_rank)
            assert set(part.heads) <= set(held), part
            # Offsets address the same heads on both sides.
            assert held[part.src_offset : part.src_offset + len(part.heads)] == part.heads
            assert wanted[part.dst_offset : part.dst_offset + len(part.heads)] == part.heads
            received += list(part.heads)
        assert sorted(received) == list(wanted)  # each head exactly once
    # One contiguous part per (prefill rank, decode rank) pair at most.
    pairs = [(p.src_rank, p.dst_rank) for p in plan]
    assert len(pairs) == len(set(pairs))


def test_replicated_heads_spread_over_their_holders() -> None:
    # 2 KV heads, prefill TP 8 (4 holders each), decode TP 4: no holder sends twice.
    plan = handoff_plan(2, 8, 4)
    senders = [p.src_rank for p in plan]
    assert len(senders) == len(set(senders)) == 4
    for p in plan:
        assert p.src_rank // 4 == p.heads.start


def test_a_plan_between_equal_groups_is_rank_to_rank() -> None:
    for num_kv, tp in itertools.product((2, 8), (1, 2)):
        plan = handoff_plan(num_kv, tp, tp)
        assert [(p.src_rank, p.dst_rank) for p in plan] == [(r, r) for r in range(tp)]
