"""The inputs a verify CUDA graph replays, laid out on the host (CPU, milliseconds): real
tokens land at the rows and cache slots the eager step gives them, everything else in
the scratch block, and the sampled rows are the eager step's rows at a stride of q."""

from __future__ import annotations

import random

import torch

from engine.core.batch import ScheduledSeq
from engine.model.attention_metadata import build_metadata
from engine.model.step_tokens import logits_rows
from engine.model.verify_graphs import logits_rows as graph_logits_rows
from engine.model.verify_graphs import pack_inputs
from engine.sampling_params import GREEDY

BLOCK_SIZE, NUM_LAYERS, SCRATCH, Q = 4, 3, 99, 5


def _batch(rng: random.Random) -> list[ScheduledSeq]:
    seqs = []
    for i in range(6):
        num_tokens = rng.randint(1, Q)
        start = rng.randint(0, 30)
        blocks = rng.sample(range(SCRATCH), -(-(start + num_tokens) // BLOCK_SIZE))
        tokens = tuple(rng.randrange(1000) for _ in range(num_tokens))
        sample = i != 2  # one chunk that samples nothing
        seqs.append(
            ScheduledSeq(f"r{i}", tokens, start, tuple(blocks), sample, GREEDY, 0, num_tokens - 1)
        )
    return seqs


def test_packed_inputs_match_the_eager_step() -> None:
    rng = random.Random(0)
    for _ in range(20):
        seqs = _batch(rng)
        size = 8
        packed = pack_inputs(
            seqs,
            size,
            Q,
            block_size=BLOCK_SIZE,
            rows_per_block=NUM_LAYERS * 2 * BLOCK_SIZE,
            scratch_block=SCRATCH,
        )
        eager = build_metadata(
            [len(s.token_ids) for s in seqs],
            [s.start_position for s in seqs],
            [s.block_table for s in seqs],
            BLOCK_SIZE,
            NUM_LAYERS,
            torch.device("cpu"),
        )
        real = [i * Q + j for i, s in enumerate(seqs) for j in range(len(s.token_ids))]
        ids, positions, rows = packed.tokens
        assert ids[real].tolist() == [t for s in seqs for t in s.token_ids]
        assert positions[real].tolist() == eager.positions.tolist()
        assert rows[real].tolist() == eager.slot_rows.tolist()
        padding = sorted(set(range(size * Q)) - set(real))
        scratch_row = SCRATCH * NUM_LAYERS * 2 * BLOCK_SIZE
        assert set(rows[padding].tolist()) == {scratch_row}
        assert packed.seqs[0].tolist() == [i * Q for i in range(size)]
        assert packed.seqs[1].tolist() == [len(s.token_ids) for s in seqs] + [1, 1]
        assert packed.seqs[2, : len(seqs)].tolist() == [s.start_position for s in seqs]
        assert packed.table[len(seqs) :, 0].tolist() == [SCRATCH, SCRATCH]
        # The sampled rows are the eager step's, moved to the graph's layout.
        eager_rows = logits_rows(seqs)
        assert [real[r] for r in eager_rows] == graph_logits_rows(seqs, Q)
