"""A step's tokens: which logits rows it samples, the sampling itself, and the result.

A sequence that samples takes one logits row, the last of its inputs; one with proposals
to verify (ScheduledSeq.num_draft_tokens = k) takes k + 1 rows, one after its newest
known token and one after each proposal. Every row is sampled exactly as a plain step
would sample that position (the counter-based noise of (seed, position)), so
verification only compares: `engine.spec.speculation.accepted_prefix` keeps the
proposals the sampler agrees with.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.core.batch import ScheduledSeq
from engine.model.sampler import SamplingBatch, is_greedy, sample
from engine.spec.speculation import accepted_prefix

StepTokens = dict[str, int | tuple[int, ...]]


def logits_rows(seqs: Sequence[ScheduledSeq]) -> list[int]:
    """Index into the packed tokens of every row the step samples, in batch order."""
    rows: list[int] = []
    end = 0
    for s in seqs:
        end += s.num_tokens
        if s.sample:
            rows.extend(range(end - 1 - s.num_draft_tokens, end))
    return rows


def sample_rows(logits: torch.Tensor, sampled_seqs: Sequence[ScheduledSeq]) -> torch.Tensor:
    """One token per logits row ([rows, V], the rows of `logits_rows`), int64 [rows]."""
    if all(is_greedy(s.sampling) for s in sampled_seqs):
        return logits.argmax(dim=-1)  # sample()'s greedy result, without its tensors
    params, seeds, positions = [], [], []
    for s in sampled_seqs:
        first = s.end_position - s.num_draft_tokens
        for position in range(first, s.end_position + 1):
            params.append(s.sampling)
            seeds.append(s.seed)
            positions.append(position)
    batch = SamplingBatch.build(
        params, seeds, positions, vocab_size=logits.shape[-1], device=logits.device
    )
    return sample(logits, batch)


class PendingTokens:
    """The sampled tokens of a launched step, on their way to the host."""

    __slots__ = ("_req_ids", "_host", "_ready", "_proposals")

    def __init__(
        self,
        req_ids: list[str],
        host: torch.Tensor,
        ready: torch.cuda.Event | None,
        proposals: list[tuple[int, ...]] | None = None,
    ) -> None:
        self._req_ids = req_ids
        self._host = host
        self._ready = ready
        # Per sampling sequence, the proposals its rows verify (None: no sequence has any).
        self._proposals = proposals

    def result(self) -> StepTokens:
        """req_id → sampled token, or the tokens a verification kept; waits for the step
        (and only for it)."""
        if self._ready is not None:
            self._ready.synchronize()
        if self._proposals is None:
            tokens = self._host[: len(self._req_ids)].tolist()
            return dict(zip(self._req_ids, tokens, strict=True))
        tokens = self._host.tolist()
        out: StepTokens = {}
        row = 0
        for req_id, proposals in zip(self._req_ids, self._proposals, strict=True):
            if proposals:
                out[req_id] = accepted_prefix(proposals, tokens[row : row + len(proposals) + 1])
            else:
                out[req_id] = tokens[row]
            row += len(proposals) + 1
        return out
