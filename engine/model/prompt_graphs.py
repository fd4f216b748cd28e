"""CUDA graphs of a step that runs one prompt chunk alone, one per padded token count.

A prompt of a few hundred tokens on a small model is bound by the host launching its
kernels, not by the GPU: eagerly, its time moves with the host's state; replayed from a
graph, it is a fraction of that and steady (docs/benchmarks.md, "Prompt CUDA graphs").
It is the whole time to first token of a lone request, on a prefill worker and on a
colocated engine alike. Each graph here replays the whole
forward of one sequence of up to `q` tokens, attending to its cached prefix with the
varlen Triton kernel (the verifying step's layout, engine.model.verify_graphs, with one
sequence), and the LM head on its last real token only.

A chunk of n tokens runs the graph of the next captured count q >= n: rows n..q-1 write
their K/V into the scratch block no request owns, the kernel computes no attention for
them, and no logits are taken from them. A step of several sequences, one with a
proposal or a placeholder token, or one whose prompt streams its KV layer by layer runs
eagerly (the model runner decides).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from engine.core.batch import Batch
from engine.model.attention import paged_step
from engine.model.attention_metadata import PagedAttentionMetadata, VarlenGroup
from engine.model.cuda_graphs import capture_graphs
from engine.model.verify_graphs import GraphsOverCache, PackedBuffers, pack_inputs

log = logging.getLogger(__name__)


def prompt_graph_sizes(max_tokens: int) -> list[int]:
    """Token counts to capture: 16, 24, 32, 48, 64, ... (steps of 1.5x and 4/3) up to
    `max_tokens`, which is always one; none for 0. A chunk pads by less than 50 %."""
    if max_tokens <= 0:
        return []
    sizes, size = [], 16
    while size < max_tokens:
        sizes += [size, size * 3 // 2]
        size *= 2
    return sorted({s for s in sizes if s < max_tokens} | {max_tokens})


def within_context(sizes: Sequence[int], context: int) -> list[int]:
    """`sizes` for a model of `context` tokens: none past it, and one at it if any was."""
    if not sizes or max(sizes) <= context:
        return list(sizes)
    return [n for n in sizes if n < context] + [context]


def fits_prompt_graph(batch: Batch, max_tokens: int, max_blocks_per_seq: int) -> bool:
    """True for a step of one sequence of 1..max_tokens tokens, with no proposals, whose
    block table holds its tokens and fits a graph's static table. (A table too short for
    its tokens runs eagerly, where the batch's checks name the request.)"""
    if len(batch.seqs) != 1 or batch.num_draft_tokens:
        return False
    seq = batch.seqs[0]
    blocks = len(seq.block_table)
    return (
        seq.num_tokens <= max_tokens
        and blocks <= max_blocks_per_seq
        and blocks * batch.block_size >= seq.end_position
    )


class PromptGraphs(GraphsOverCache):
    """Captured forwards of one sequence's chunk of up to q tokens; `run` replays one."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_storage: torch.Tensor,
        scratch_block: int,
        block_size: int,
        max_blocks_per_seq: int,
        token_counts: Sequence[int],
    ) -> None:
        super().__init__(model, kv_storage, scratch_block, block_size, max_blocks_per_seq)
        if not token_counts or min(token_counts) < 1:
            raise ValueError(f"token counts must be >= 1, got {list(token_counts)}")
        self.token_counts = sorted(set(token_counts))
        self.max_tokens = self.token_counts[-1]
        # A fourth per-sequence row: the packed row whose logits the step takes.
        self._buffers = PackedBuffers(
            1, self.max_tokens, max_blocks_per_seq, kv_storage.device, seq_rows=4
        )

    def _forward(self, q: int) -> torch.Tensor:
        buffers = self._buffers
        group = VarlenGroup(
            block_table=buffers.table[:1],
            q_starts=buffers.seqs[0, :1],
            q_lens=buffers.seqs[1, :1],
            positions=buffers.seqs[2, :1],
            max_q=q,
        )
        meta = PagedAttentionMetadata(
            positions=buffers.tokens[1, :q],
            slot_rows=buffers.tokens[2, :q],
            rows_per_layer=2 * self.block_size,
            block_size=self.block_size,
            groups=(group,),
        )
        with paged_step(meta, self.kv_storage):
            return self.model(
                input_ids=buffers.tokens[0, :q][None],
                position_ids=buffers.tokens[1, :q][None],
                use_cache=False,
                logits_to_keep=buffers.seqs[3, :1],
            ).logits[0]

    def _stage(self, batch: Batch | None, q: int) -> None:
        """Write one step's inputs (None: a padding sequence of one token) for graph q."""
        seqs = () if batch is None else batch.seqs
        packed = pack_inputs(
            seqs,
            1,
            q,
            block_size=self.block_size,
            rows_per_block=self._rows_per_block,
            scratch_block=self.scratch_block,
        )
        last_row = packed.seqs[1:2] - 1  # the chunk's last token, the one that samples
        self._buffers.stage(packed.tokens, np.concatenate((packed.seqs, last_row)), packed.table)

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture every token count, largest first (they share one pool)."""
        self._stage(None, self.max_tokens)
        self._graphs = capture_graphs(self.token_counts, self._forward, self.kv_storage.device)
        log.info("captured prompt CUDA graphs for %s tokens", self.token_counts)

    def can_run(self, batch: Batch) -> bool:
        return bool(self._graphs) and fits_prompt_graph(
            batch, self.max_tokens, self.max_blocks_per_seq
        )

    def run(self, batch: Batch) -> torch.Tensor:
        """Replay the graph for this one-sequence step; logits [1, V] of its last token (a
        view). The caller has checked the block ids (the eager path's check)."""
        q = next(n for n in self.token_counts if n >= batch.seqs[0].num_tokens)
        self._stage(batch, q)
        graph, logits = self._graphs[q]
        graph.replay()
        self.num_replays += 1
        return logits
