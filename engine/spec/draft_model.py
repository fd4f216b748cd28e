"""Speculative decoding's draft model: a small model with the target's vocabulary fills the
proposal slots of a verifying step.

It runs in the same worker on a `ModelRunner` of its own, with its own paged KV cache
indexed by the target's block ids: a request's blocks hold its target KV in the target's
cache and its draft KV at the same rows of the draft's, so the scheduler's one block
table serves both and nothing else needs allocating or freeing. The draft KV of a
request is built when it first speculates (its whole context: a hand-off or a prefix-
cache hit brings the target's KV only), then kept up to date by each verifying step
(`ScheduledSeq.draft_context_ids` names the tokens it still lacks).

For k proposals the draft model runs k passes: the first over the missing context and
the newest token, then one token each, fed on the device from the pass before (the
runner's placeholder mechanism, as with scheduling a step ahead). Each proposal is
sampled as the target samples that position (the request's sampling parameters and the
counter-based noise of (seed, position)): greedy proposals are the draft's argmax, and
sampled ones are coupled with the target's draw, so they are accepted whenever both
models draw the same token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, cast

from engine.core.batch import Batch, ScheduledSeq
from engine.core.request import PLACEHOLDER_TOKEN
from engine.model.model_spec import ModelSpec
from engine.spec.speculation import PROPOSAL_TOKEN

if TYPE_CHECKING:
    from engine.model.model_runner import ModelRunner


class Proposer(Protocol):
    """Fills a batch's proposal slots (PROPOSAL_TOKEN) before the target verifies them."""

    def propose(self, batch: Batch) -> Batch: ...


def fill_proposals(batch: Batch, drafter: Proposer | None) -> Batch:
    """The batch with its proposal slots filled by the draft model; ValueError for slots
    that no draft model fills."""
    if drafter is not None:
        batch = drafter.propose(batch)
    for s in batch.seqs:
        if PROPOSAL_TOKEN in s.token_ids:
            raise ValueError(f"request {s.req_id}: proposal slots but no draft model")
    return batch


def check_draft_vocabulary(target: ModelSpec, draft: ModelSpec) -> None:
    """A draft model must score the target's token ids: same vocabulary size."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"draft model {draft.name} has a vocabulary of {draft.vocab_size} tokens, the "
            f"target {target.name} {target.vocab_size}: a draft must share the target's "
            "tokenizer"
        )


class DraftModel:
    """Fills proposal slots (PROPOSAL_TOKEN) with the draft model's tokens."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def propose(self, batch: Batch) -> Batch:
        """The batch with every proposal slot filled (other sequences unchanged)."""
        todo = [s for s in batch.seqs if s.num_draft_tokens and PROPOSAL_TOKEN in s.token_ids]
        if not todo:
            return batch
        first = []
        for s in todo:
            known = s.token_ids[: len(s.token_ids) - s.num_draft_tokens]
            context = s.draft_context_ids + known
            first.append(
                ScheduledSeq(
                    s.req_id,
                    context,
                    s.start_position - len(s.draft_context_ids),
                    s.block_table,
                    True,
                    s.sampling,
                    s.seed,
                )
            )
        pending = [self.runner.launch(Batch(tuple(first), batch.block_size))]
        for i in range(1, max(s.num_draft_tokens for s in todo)):
            step = tuple(
                # Proposal i sits at (newest position) + i; the runner feeds it from the
                # pass before, on the device.
                ScheduledSeq(
                    s.req_id,
                    (PLACEHOLDER_TOKEN,),
                    s.end_position - s.num_draft_tokens - 1 + i,
                    s.block_table,
                    True,
                    s.sampling,
                    s.seed,
                )
                for s in todo
                if s.num_draft_tokens > i
            )
            pending.append(self.runner.launch(Batch(step, batch.block_size)))
        passes = [p.result() for p in pending]  # one wait: every pass is queued already
        filled = {}
        for s in todo:
            proposals = tuple(cast(int, p[s.req_id]) for p in passes[: s.num_draft_tokens])
            known = s.token_ids[: len(s.token_ids) - s.num_draft_tokens]
            filled[s.req_id] = s._replace(token_ids=known + proposals)
        return Batch(
            tuple(filled.get(s.req_id, s) for s in batch.seqs),
            batch.block_size,
            batch.num_draft_tokens,
        )
