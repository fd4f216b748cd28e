"""The one contract between scheduler and model runner: an immutable batch description."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

from engine.sampling_params import SamplingParams


class ScheduledSeq(NamedTuple):
    """One request's share of a step: a prompt chunk, a recompute chunk or one decode token.

    Immutable; a NamedTuple because the scheduler builds one per request every step, and
    a tuple costs a third less to build than a frozen dataclass.
    """

    req_id: str
    token_ids: tuple[int, ...]  # the tokens whose KV this step computes
    start_position: int  # position of token_ids[0] (= tokens already in the cache)
    block_table: tuple[int, ...]  # every block the request holds, in order
    sample: bool  # True when this chunk reaches the last known token
    sampling: SamplingParams
    seed: (
        int  # randomness of the token at position `end_position` derives from (seed, end_position)
    )
    # Speculative decoding: the last this many of token_ids are proposals to verify. The
    # step samples a token after each input token from the one before them on (its
    # positions end_position - num_draft_tokens .. end_position), and keeps the proposals
    # the sampler agrees with (engine.spec.speculation). PROPOSAL_TOKEN marks a proposal
    # the runner's draft model fills in first.
    num_draft_tokens: int = 0
    # Draft model: the tokens just before token_ids whose draft KV is not cached yet.
    draft_context_ids: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end_position(self) -> int:
        """Position of the token this step samples (one past the last computed)."""
        return self.start_position + len(self.token_ids)

    @property
    def newest_token_index(self) -> int:
        """Index in token_ids of the request's newest token, the one an async step may
        still be sampling: the last, or the first of a verifying sequence (proposals
        follow it)."""
        return 0 if self.num_draft_tokens else len(self.token_ids) - 1

    @property
    def num_sampled(self) -> int:
        """Tokens this step samples for the sequence: one, or one per verified position."""
        return self.num_draft_tokens + 1 if self.sample else 0


# tuple.__new__ on the class, called from C: the NamedTuple's own __new__ is a Python
# function, and the scheduler builds one sequence per running request per step.
_new_scheduled_seq = functools.partial(tuple.__new__, ScheduledSeq)


def plain_seq(
    req_id: str,
    token_ids: tuple[int, ...],
    start_position: int,
    block_table: tuple[int, ...],
    sample: bool,
    sampling: SamplingParams,
    seed: int,
) -> ScheduledSeq:
    """`ScheduledSeq(...)` of the same arguments (no proposals, no draft context), at
    less than half its cost."""
    return _new_scheduled_seq(  # type: ignore[no-any-return]
        (req_id, token_ids, start_position, block_table, sample, sampling, seed, 0, ())
    )


@dataclass(frozen=True)
class Batch:
    """Everything the runner needs for one packed forward pass."""

    seqs: tuple[ScheduledSeq, ...]
    block_size: int
    num_draft_tokens: int = 0  # proposals in the whole batch (0: nothing to verify)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs
