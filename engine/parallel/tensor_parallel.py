"""Tensor parallelism inside one worker: the group, its collectives and the sharded layers.

A worker of TP size N is N processes, one per GPU (or N CPU processes over gloo). Each
runs the same transformers model definition built from a *local* config (its share of
the attention heads, KV heads and MLP width), with four modules swapped in:

* `RowParallel` around `o_proj` and `down_proj`: the local product, then one all-reduce.
* `VocabParallelEmbedding`: each rank holds a slice of the vocabulary's rows; a token
  outside it looks up zeros, and an all-reduce adds the one rank's row to everyone.
* `VocabParallelHead`: each rank computes the logits of its vocabulary slice; an
  all-gather gives every rank the full row (every rank samples the same token, so the
  ranks' device-side token buffers agree without another message).

Column-parallel QKV and gate/up need no module of their own: they are plain `Linear`s
of the local width, so the one-row GEMV and the packing of sibling projections apply
to them unchanged.

Why our own layers rather than transformers' tensor-parallel plans or DTensor: those
wrap parameters in DTensors whose dispatch runs on every call (host work the CUDA graphs
and the compiled decoder would have to trace through), and need the process group to
exist when the model is built. Here the collectives are the functional ops
(`_c10d_functional.all_reduce` / `all_gather_into_tensor`) on the worker's own group:
torch.compile traces them, CUDA graphs capture them, and on CPU they run over gloo.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.parallel.tp_heads import check_tp_size, kv_heads_of_rank, q_heads_of_rank


@dataclass(frozen=True)
class TPRank:
    """This process's place in its worker's TP group; `group_name` names the process
    group the layers' collectives run on ("" for a group of one)."""

    rank: int = 0
    size: int = 1
    group_name: str = ""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} outside a group of {self.size}")
        if self.size > 1 and not self.group_name:
            raise ValueError("a group of more than one rank needs its process group's name")

    @property
    def is_leader(self) -> bool:
        return self.rank == 0


SINGLE = TPRank()


def join_tp_group(rendezvous: str, rank: int, size: int, device: torch.device) -> TPRank:
    """Join the worker's TP group through a file rendezvous on the node (no listening
    socket of ours); NCCL between GPUs, gloo on CPU. The group is this process's default
    group: a worker process belongs to one TP group, and its KV channels to other
    workers are process groups of their own."""
    if size == 1:
        return SINGLE
    if device.type == "cpu":
        # Gloo's ranks connect over loopback: the group never leaves the node.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    elif device.index is None:  # NCCL wants the GPU by index ("cuda" is Ray's one GPU)
        device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"file://{rendezvous}",
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=300),
        device_id=device if device.type == "cuda" else None,
    )
    group = dist.group.WORLD
    assert group is not None
    return TPRank(rank, size, group.group_name)


def all_reduce(x: torch.Tensor, tp: TPRank) -> torch.Tensor:
    """Sum of `x` over the group (a new tensor)."""
    if tp.size == 1:
        return x
    ops = torch.ops._c10d_functional
    return ops.wait_tensor(ops.all_reduce(x, "sum", tp.group_name))


def all_gather_last_dim(x: torch.Tensor, tp: TPRank) -> torch.Tensor:
    """The ranks' `x` side by side along the last dimension, in rank order."""
    if tp.size == 1:
        return x
    ops = torch.ops._c10d_functional
    stacked = ops.wait_tensor(ops.all_gather_into_tensor(x.contiguous(), tp.size, tp.group_name))
    # [size * rows, cols] → [rows, size * cols]
    parts = stacked.view(tp.size, *x.shape)
    return torch.cat(parts.unbind(0), dim=-1)


def min_over_group(value: int, tp: TPRank, device: torch.device) -> int:
    """The smallest of every rank's `value` (the KV cache's block count: every rank's
    cache must hold the same blocks)."""
    if tp.size == 1:
        return value
    t = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


class RowParallel(torch.nn.Module):
    """A Linear whose input features are split over the group: the local product plus
    one all-reduce. The bias, if any, is added by rank 0's share only."""

    def __init__(self, linear: torch.nn.Linear, tp: TPRank) -> None:
        super().__init__()
        self.linear = linear
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(self.linear(x), self.tp)


class VocabParallelEmbedding(torch.nn.Module):
    """Rows [start, start + rows) of the embedding on this rank (padded past the vocab)."""

    def __init__(self, weight: torch.Tensor, start: int, tp: TPRank) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.start = start
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        rows = torch.nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(rows.masked_fill(outside[..., None], 0), self.tp)


class VocabParallelHead(torch.nn.Module):
    """The LM head's rows of this rank's vocabulary slice; returns the full logits row."""

    def __init__(self, weight: torch.Tensor, vocab_size: int, tp: TPRank) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.vocab_size = vocab_size
        self.tp = tp

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = torch.nn.functional.linear(hidden, self.weight)
        return all_gather_last_dim(local, self.tp)[..., : self.vocab_size]


@dataclass(frozen=True)
class ShardPlan:
    """How a checkpoint tensor's rows or columns map onto one rank (see `slice_for`)."""

    tp: TPRank
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    def __post_init__(self) -> None:
        check_tp_size(self.num_q_heads, self.num_kv_heads, self.tp.size)
        if self.intermediate_size % self.tp.size:
            raise ValueError(
                f"tensor parallel size {self.tp.size} does not divide the model's MLP width "
                f"{self.intermediate_size}"
            )

    @property
    def vocab_rows_per_rank(self) -> int:
        return -(-self.vocab_size // self.tp.size)

    @property
    def vocab_start(self) -> int:
        return self.tp.rank * self.vocab_rows_per_rank

    def _heads(self, heads: range) -> slice:
        return slice(heads.start * self.head_dim, heads.stop * self.head_dim)

    def index_for(self, name: str) -> tuple[slice, ...]:
        """The rows (and columns) of checkpoint tensor `name` this rank holds: an index
        a safetensors slice reads without loading the rest."""
        tp, everything = self.tp, slice(None)
        module = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else name
        if tp.size == 1:
            return (everything,)
        width = self.intermediate_size // tp.size
        mlp = slice(tp.rank * width, (tp.rank + 1) * width)
        q = self._heads(q_heads_of_rank(self.num_q_heads, tp.size, tp.rank))
        if module == "q_proj":
            return (q,)
        if module in ("k_proj", "v_proj"):
            return (self._heads(kv_heads_of_rank(self.num_kv_heads, tp.size, tp.rank)),)
        if module in ("gate_proj", "up_proj"):
            return (mlp,)
        if module in ("o_proj", "down_proj") and name.endswith(".weight"):
            return (everything, q if module == "o_proj" else mlp)
        if module in ("embed_tokens", "lm_head"):
            return (slice(self.vocab_start, self.vocab_start + self.vocab_rows_per_rank),)
        return (everything,)  # norms, a row-parallel bias: every rank reads them whole

    def finish(self, name: str, part: torch.Tensor) -> torch.Tensor:
        """What `index_for` cannot express: a vocabulary slice padded with zero rows past
        the vocabulary's end, a row-parallel bias kept by rank 0 only (the all-reduce
        would add it once per rank)."""
        if self.tp.size == 1:
            return part
        module = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else name
        if module in ("embed_tokens", "lm_head"):
            missing = self.vocab_rows_per_rank - part.shape[0]
            if missing:
                part = torch.cat([part, part.new_zeros(missing, *part.shape[1:])])
        elif module in ("o_proj", "down_proj") and name.endswith(".bias") and not self.tp.is_leader:
            part = torch.zeros_like(part)
        return part
