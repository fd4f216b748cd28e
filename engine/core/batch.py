"""The one contract between scheduler and model runner: an immutable batch description."""

from __future__ import annotations

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

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end_position(self) -> int:
        """Position of the token this step samples (one past the last computed)."""
        return self.start_position + len(self.token_ids)


@dataclass(frozen=True)
class Batch:
    """Everything the runner needs for one packed forward pass."""

    seqs: tuple[ScheduledSeq, ...]
    block_size: int

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs
