"""CUDA graphs of speculative decoding's verifying step: up to q tokens per sequence.

A verifying step is a short chunk per request (its newest token and its proposals)
attending to its cache. Eagerly, at small batches, the launches of that step cost more
than its GPU work, as a plain decode step's do (engine.model.cuda_graphs). Each graph
here replays the whole forward for n sequences of up to q = 1 + num_speculative_tokens
tokens each, laid out at a fixed stride of q: sequence i's tokens are rows
i*q .. i*q + len - 1. The varlen Triton kernel (engine.model.kernels.triton_prefill) takes each
sequence's real token count from a device tensor and its grid from (n, q), so one graph
serves every mix of proposal counts, plain decodes (one token) included.

Rows past a sequence's tokens, and padding sequences up to the graph's size, write
their K/V into a scratch block no request owns; the kernel computes no output for them
and their logits are never read. The LM head runs on every row; `logits_rows` says
which rows a step samples.

`pack_inputs` (plain numpy, tested on CPU) lays a batch out; the class copies it to the
static buffers with one host-to-device copy and replays.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.core.batch import Batch, ScheduledSeq
from engine.model.attention import paged_step
from engine.model.attention_metadata import PagedAttentionMetadata, VarlenGroup
from engine.model.cuda_graphs import capture_graphs, captured_or_none
from engine.model.staging import to_device

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PackedVerify:
    """A batch laid out for a graph of `size` sequences of `q` token slots."""

    tokens: np.ndarray  # [3, size * q]: token id, position, cache row of layer 0's K
    seqs: np.ndarray  # [3, size]: first packed row, token count, position of the first
    table: np.ndarray  # [size, width] block tables (padding: the scratch block)


def pack_inputs(
    seqs: Sequence[ScheduledSeq],
    size: int,
    q: int,
    *,
    block_size: int,
    rows_per_block: int,
    scratch_block: int,
) -> PackedVerify:
    """The graph inputs of `seqs` (each with 1..q tokens) padded to `size` sequences."""
    n = len(seqs)
    lens = np.fromiter((len(s.token_ids) for s in seqs), dtype=np.int64, count=n)
    starts = np.fromiter((s.start_position for s in seqs), dtype=np.int64, count=n)
    width = max((len(s.block_table) for s in seqs), default=1)
    table = np.full((size, width), scratch_block, dtype=np.int64)
    for i, s in enumerate(seqs):
        table[i, : len(s.block_table)] = s.block_table
    offsets = np.arange(q, dtype=np.int64)
    positions = np.zeros((size, q), dtype=np.int64)
    positions[:n] = starts[:, None] + offsets[None, :]
    positions[n:] = offsets[None, :]
    valid = np.zeros((size, q), dtype=bool)
    valid[:n] = offsets[None, :] < lens[:, None]
    ids = np.zeros((size, q), dtype=np.int64)
    ids[valid] = np.fromiter(
        (t for s in seqs for t in s.token_ids), dtype=np.int64, count=int(lens.sum())
    )
    # Real tokens: their slot; the rest: the scratch block's first row.
    block_index = np.where(valid, positions // block_size, 0)
    blocks = np.take_along_axis(table, block_index, axis=1)
    rows = np.where(
        valid, blocks * rows_per_block + positions % block_size, scratch_block * rows_per_block
    )
    seq_info = np.zeros((3, size), dtype=np.int64)
    seq_info[0] = np.arange(size) * q
    seq_info[1, :n] = lens
    seq_info[1, n:] = 1
    seq_info[2, :n] = starts
    tokens = np.stack((ids.reshape(-1), positions.reshape(-1), rows.reshape(-1)))
    return PackedVerify(tokens, seq_info, table)


def logits_rows(seqs: Sequence[ScheduledSeq], q: int) -> list[int]:
    """The rows of the graph's logits a step samples, in the order the sampler takes them
    (engine.model.step_tokens.logits_rows, at a stride of q)."""
    rows: list[int] = []
    for i, s in enumerate(seqs):
        if s.sample:
            end = i * q + len(s.token_ids)
            rows.extend(range(end - 1 - s.num_draft_tokens, end))
    return rows


class PackedBuffers:
    """The static inputs a graph of packed sequences reads (`pack_inputs`' three arrays,
    `seq_rows` rows of per-sequence values), and their staging: the host writes them into
    one pinned buffer, one host-to-device copy, then device copies into place."""

    def __init__(
        self, max_seqs: int, q: int, width: int, device: torch.device, seq_rows: int = 3
    ) -> None:
        self.tokens = torch.zeros((3, max_seqs * q), dtype=torch.long, device=device)
        self.seqs = torch.zeros((seq_rows, max_seqs), dtype=torch.long, device=device)
        self.table = torch.zeros((max_seqs, width), dtype=torch.long, device=device)
        count = self.tokens.numel() + self.seqs.numel() + self.table.numel()
        self._host = torch.empty(count, dtype=torch.long).pin_memory()
        self._staging = torch.empty(count, dtype=torch.long, device=device)
        # The last copy out of `_host` must finish before the host rewrites it.
        self._host_free = torch.cuda.Event()
        self._host_free.record()

    def stage(self, tokens: np.ndarray, seqs: np.ndarray, table: np.ndarray) -> None:
        """Copy [3, T] token rows, [r, n] sequence rows and an [n, w] table into the
        leading parts of the static buffers."""
        parts = (tokens.reshape(-1), seqs.reshape(-1), table.reshape(-1))
        count = sum(p.size for p in parts)
        self._host_free.synchronize()
        np.concatenate(parts, out=self._host.numpy()[:count])
        staging = self._staging[:count]
        staging.copy_(self._host[:count], non_blocking=True)
        self._host_free.record()
        a, b = parts[0].size, parts[0].size + parts[1].size
        rows, size = seqs.shape
        self.tokens[:, : tokens.shape[1]].copy_(staging[:a].view(3, -1))
        self.seqs[:rows, :size].copy_(staging[a:b].view(rows, size))
        self.table[:size, : table.shape[1]].copy_(staging[b:count].view(size, -1))


class GraphsOverCache:
    """What a kind of CUDA graph over a paged KV cache holds: the model, the cache (whose
    block `scratch_block` takes padding rows' K/V), its geometry, and the graphs."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_storage: torch.Tensor,
        scratch_block: int,
        block_size: int,
        max_blocks_per_seq: int,
    ) -> None:
        if not kv_storage.is_cuda:
            raise ValueError("CUDA graphs need a CUDA KV cache")
        self.model = model
        self.kv_storage = kv_storage
        self.scratch_block = scratch_block
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self._rows_per_block = kv_storage.shape[1] * 2 * block_size
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_replays = 0


class VerifyGraphs(GraphsOverCache):
    """Captured forwards of batches of up to `q` tokens per sequence; `run` replays one."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_storage: torch.Tensor,
        scratch_block: int,
        block_size: int,
        max_blocks_per_seq: int,
        batch_sizes: Sequence[int],
        q: int,
    ) -> None:
        super().__init__(model, kv_storage, scratch_block, block_size, max_blocks_per_seq)
        if q < 2:
            raise ValueError(f"a verifying step has at least 2 tokens per sequence, got {q}")
        self.batch_sizes = sorted(set(batch_sizes))
        self.max_batch_size = self.batch_sizes[-1]
        self.q = q
        self._buffers = PackedBuffers(self.max_batch_size, q, max_blocks_per_seq, kv_storage.device)
        self._tokens = self._buffers.tokens
        self._seqs = self._buffers.seqs
        self._table = self._buffers.table

    def _metadata(self, n: int) -> PagedAttentionMetadata:
        group = VarlenGroup(
            block_table=self._table[:n],
            q_starts=self._seqs[0, :n],
            q_lens=self._seqs[1, :n],
            positions=self._seqs[2, :n],
            max_q=self.q,
        )
        return PagedAttentionMetadata(
            positions=self._tokens[1, : n * self.q],
            slot_rows=self._tokens[2, : n * self.q],
            rows_per_layer=2 * self.block_size,
            block_size=self.block_size,
            groups=(group,),
        )

    def _forward(self, n: int, meta: PagedAttentionMetadata) -> torch.Tensor:
        with paged_step(meta, self.kv_storage):
            return self.model(
                input_ids=self._tokens[0, : n * self.q][None],
                position_ids=self._tokens[1, : n * self.q][None],
                use_cache=False,
            ).logits[0]

    def _stage(self, packed: PackedVerify) -> None:
        self._buffers.stage(packed.tokens, packed.seqs, packed.table)

    def _pack(self, seqs: Sequence[ScheduledSeq], size: int) -> PackedVerify:
        return pack_inputs(
            seqs,
            size,
            self.q,
            block_size=self.block_size,
            rows_per_block=self._rows_per_block,
            scratch_block=self.scratch_block,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture every batch size, largest first (they share one pool)."""
        self._stage(self._pack((), self.max_batch_size))
        self._graphs = capture_graphs(
            self.batch_sizes, lambda n: self._forward(n, self._metadata(n)), self.kv_storage.device
        )
        log.info(
            "captured verify CUDA graphs (%d tokens a sequence) for %s", self.q, self.batch_sizes
        )

    def can_run(self, batch: Batch) -> bool:
        """True when the batch fits a captured size and every sequence has 1..q tokens."""
        if not self._graphs or len(batch.seqs) > self.max_batch_size:
            return False
        return all(
            len(s.token_ids) <= self.q and len(s.block_table) <= self.max_blocks_per_seq
            for s in batch.seqs
        )

    def run(
        self,
        batch: Batch,
        sources: Sequence[int] | None = None,
        last_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Replay the graph for this batch; logits [size * q, V] (a view; rows per
        `logits_rows`). The caller has checked the block ids (the eager path's check).
        `sources[i]` >= 0: sequence i's newest token is still being sampled by the step
        before; it is read on the device from that row of `last_tokens`."""
        size = next(s for s in self.batch_sizes if s >= len(batch.seqs))
        self._stage(self._pack(batch.seqs, size))
        if sources is not None and last_tokens is not None:
            seqs = batch.seqs
            where = [
                i * self.q + seqs[i].newest_token_index for i, r in enumerate(sources) if r >= 0
            ]
            rows = [r for r in sources if r >= 0]
            index = to_device(where + rows, torch.long, self._tokens.device).view(2, -1)
            self._tokens[0, index[0]] = last_tokens[index[1]]
        graph, logits = self._graphs[size]
        graph.replay()
        self.num_replays += 1
        return logits


def capture_verify_graphs(
    model: torch.nn.Module,
    kv_storage: torch.Tensor,
    batch_sizes: Sequence[int],
    max_blocks_per_seq: int,
    q: int,
) -> VerifyGraphs | None:
    """Graphs of verifying steps, captured now (start-up) over a cache whose last block is
    the scratch block; None, with a warning, when capture fails (they then run eagerly)."""
    graphs = VerifyGraphs(
        model,
        kv_storage,
        scratch_block=kv_storage.shape[0] - 1,
        block_size=kv_storage.shape[3],
        max_blocks_per_seq=max_blocks_per_seq,
        batch_sizes=batch_sizes,
        q=q,
    )
    return captured_or_none(graphs, "verifying steps")
