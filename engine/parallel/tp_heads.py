"""Which KV heads each rank of a tensor-parallel group holds, and which prefill rank sends
which heads to which decode rank in a hand-off between groups of different sizes.

Plain Python: the pairing check and the tests use it without torch.

The rule (the loader's, vLLM's QKVParallelLinear's): H KV heads over tp ranks are split
into equal consecutive ranges when tp <= H; when tp > H each head is replicated on tp / H
consecutive ranks, rank r holding head r // (tp / H). Never r mod H: that pairs a rank's
KV head with query heads of another group (wrong text on GQA models).
"""

from __future__ import annotations

from dataclasses import dataclass


def tp_size_problem(num_q_heads: int, num_kv_heads: int, tp_size: int) -> str | None:
    """Why `tp_size` cannot split a model with these heads (one line naming the
    numbers), or None when it can."""
    if tp_size < 1:
        return f"tensor parallel size must be >= 1, got {tp_size}"
    if num_q_heads % tp_size:
        return (
            f"tensor parallel size {tp_size} does not divide the model's "
            f"{num_q_heads} attention heads"
        )
    if num_kv_heads % tp_size and tp_size % num_kv_heads:
        return (
            f"tensor parallel size {tp_size} neither divides nor is a multiple of the "
            f"model's {num_kv_heads} KV heads"
        )
    return None


def check_tp_size(num_q_heads: int, num_kv_heads: int, tp_size: int) -> None:
    """ValueError naming the numbers unless `tp_size` can split the model."""
    problem = tp_size_problem(num_q_heads, num_kv_heads, tp_size)
    if problem:
        raise ValueError(problem)


def kv_heads_of_rank(num_kv_heads: int, tp_size: int, rank: int) -> range:
    """The KV heads rank `rank` of a group of `tp_size` holds, in cache order."""
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} outside a group of {tp_size}")
    if tp_size <= num_kv_heads:
        if num_kv_heads % tp_size:
            raise ValueError(f"{tp_size} ranks cannot split {num_kv_heads} KV heads evenly")
        per_rank = num_kv_heads // tp_size
        return range(rank * per_rank, (rank + 1) * per_rank)
    if tp_size % num_kv_heads:
        raise ValueError(f"{tp_size} ranks cannot replicate {num_kv_heads} KV heads evenly")
    head = rank // (tp_size // num_kv_heads)
    return range(head, head + 1)


def num_local_kv_heads(num_kv_heads: int, tp_size: int) -> int:
    """How many KV heads each rank's cache holds."""
    return len(kv_heads_of_rank(num_kv_heads, tp_size, 0))


def q_heads_of_rank(num_q_heads: int, tp_size: int, rank: int) -> range:
    """The query heads rank `rank` computes (always an equal split)."""
    per_rank = num_q_heads // tp_size
    return range(rank * per_rank, (rank + 1) * per_rank)


@dataclass(frozen=True)
class HeadSlice:
    """One part of a hand-off between TP groups: `heads` (global ids, consecutive) go from
    prefill rank `src_rank` (where they sit at `src_offset` in its cache's head axis) to
    decode rank `dst_rank` (at `dst_offset`). One part is one contiguous buffer."""

    src_rank: int
    dst_rank: int
    heads: range
    src_offset: int
    dst_offset: int


def handoff_plan(num_kv_heads: int, src_tp: int, dst_tp: int) -> tuple[HeadSlice, ...]:
    """Every part of a hand-off from a group of `src_tp` ranks to one of `dst_tp`: each
    decode rank's heads come once each from a prefill rank that holds them. A head that
    several prefill ranks hold (replicated) is read from the holder whose position among
    the holders matches the decode rank's, spreading the sends over the holders."""
    parts: list[HeadSlice] = []
    for dst in range(dst_tp):
        dst_heads = kv_heads_of_rank(num_kv_heads, dst_tp, dst)
        for dst_offset, head in enumerate(dst_heads):
            holders = [
                r for r in range(src_tp) if head in kv_heads_of_rank(num_kv_heads, src_tp, r)
            ]
            src = holders[dst % len(holders)]
            src_offset = head - kv_heads_of_rank(num_kv_heads, src_tp, src).start
            last = parts[-1] if parts else None
            if (
                last is not None
                and last.dst_rank == dst
                and last.src_rank == src
                and last.heads.stop == head
                and last.src_offset + len(last.heads) == src_offset
            ):
                parts[-1] = HeadSlice(
                    src, dst, range(last.heads.start, head + 1), last.src_offset, last.dst_offset
                )
            else:
                parts.append(HeadSlice(src, dst, range(head, head + 1), src_offset, dst_offset))
    return tuple(parts)
