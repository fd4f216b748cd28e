"""Speculative decoding on the scheduler's side: which requests propose, what, and how a
verified step's tokens are kept.

A request whose only work is its newest token may carry proposals into the step: the
step computes the KV of that token and of every proposal, and samples a token after each
(one target forward pass for all of them, inside the batch where other requests decode
normally). The token after position i is the one the sampler would have picked without
speculation, given the same tokens before it: a function of (seed, position) and the
logits. The step keeps the proposals up to the first one that differs from the sampler's
token there, plus the sampler's token after the last kept one (a correction, or a bonus
when every proposal was kept). Output is therefore, token for token, what the same
request produces without speculation: greedy or seeded, whatever else runs in the batch.

For a proposal that is a single token (n-gram), accepting it exactly when the sampler
draws it is the rejection rule: accepted with probability p(d), otherwise a draw from p
without d, renormalised (the sampler's Gumbel race conditioned on d losing). A draft
model proposes with the same noise at each position (a Gumbel coupling of its
distribution with the target's), so it is accepted whenever both draw the same token.

Plain Python, no torch (the runner samples; `accepted_prefix` decides what stays).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from engine.core.batch import ScheduledSeq
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import PLACEHOLDER_TOKEN, FinishReason, Request
from engine.spec.ngram import NgramIndex
from engine.spec.spec_config import SpeculativeConfig

# A proposal slot the runner's draft model fills in before the target verifies it.
PROPOSAL_TOKEN = -2


def accepted_prefix(proposals: Sequence[int], sampled: Sequence[int]) -> tuple[int, ...]:
    """The tokens a verified step keeps: `sampled[i]` is the sampler's token after the
    i-th input of the step (len(proposals) + 1 of them); proposals stay while they equal
    it, and the sampler's token after the last one kept ends the run."""
    num_accepted = 0
    for proposal, token in zip(proposals, sampled, strict=False):
        if proposal != token:
            break
        num_accepted += 1
    return tuple(sampled[: num_accepted + 1])


@dataclass
class SpecState:
    """What speculation keeps per request: the n-gram index of its tokens, and how many
    of its tokens have their KV in the draft model's cache."""

    ngram: NgramIndex | None = None
    num_draft_computed: int = 0
    # The draft KV belongs to this incarnation of the request's blocks (a preemption
    # frees them, and the draft model must then recompute from the start).
    num_preemptions: int = 0


@dataclass
class SpecCounters:
    """Since the engine started: proposals verified, accepted, and verifications (one
    per request per verifying step)."""

    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verifications: int = 0


@dataclass
class Speculator:
    """Decides each step's proposals and books what verification kept."""

    config: SpeculativeConfig
    counters: SpecCounters = field(default_factory=SpecCounters)

    def speculates_at(self, num_running: int) -> bool:
        return self.config.speculates_at(num_running)

    @property
    def proposes_ahead(self) -> bool:
        """Proposals can be made while the newest token is still being sampled (n-gram:
        from the tokens before it), so steps need not wait for one another."""
        return not self.config.uses_draft_model

    def proposals(self, req: Request, max_proposals: int) -> tuple[int, ...]:
        """Proposals to verify after the request's newest token (its only work this
        step); () when it has none or no room for any."""
        limit = min(
            self.config.num_speculative_tokens,
            max_proposals,
            # Never propose past the request's own end: the tokens would be dropped.
            req.sampling.max_tokens - req.num_output_tokens - 1,
            (req.max_model_len or 1 << 62) - req.num_tokens - 1,
        )
        if limit < 1:
            return ()
        state = self._state(req)
        tokens = req.all_token_ids
        newest_known = tokens[-1] != PLACEHOLDER_TOKEN
        if self.config.uses_draft_model:
            # The draft model runs on the newest token: it must be known.
            return (PROPOSAL_TOKEN,) * limit if newest_known else ()
        if state.ngram is None:
            low, high = self.config.prompt_lookup_min, self.config.prompt_lookup_max
            assert low is not None and high is not None  # filled in by the config
            state.ngram = NgramIndex(low, high)
        if newest_known:
            return state.ngram.propose(tokens, limit)
        # The newest token is still being sampled (the step before runs on the device):
        # look up the known tokens, whose continuation guesses that token first and then
        # proposes what follows it. A wrong guess costs only the proposals: each is kept
        # only if it equals the sampler's token after the tokens really before it.
        known = len(tokens) - 1
        guess = state.ngram.propose(tokens, limit + 1, known)
        proposals = guess[1:]
        if PLACEHOLDER_TOKEN in proposals:  # the continuation ran into the unknown token
            proposals = proposals[: proposals.index(PLACEHOLDER_TOKEN)]
        return proposals

    def draft_context(self, req: Request, start: int) -> tuple[int, ...]:
        """Draft model: the tokens before position `start` whose draft KV is missing
        (a whole prompt the first time: a hand-off brings the target's KV only)."""
        if not self.config.uses_draft_model:
            return ()
        state = self._state(req)
        return tuple(req.all_token_ids[state.num_draft_computed : start])

    def plan(
        self,
        req: Request,
        num_done: int,
        budget: int,
        allocate_slots: Callable[[str, int, int], list[int] | None],
    ) -> tuple[int, ...]:
        """Proposals for a request whose only work this step is its newest token, their
        slots allocated; () when it has none, or no free slots for them (speculation
        never preempts anyone)."""
        proposals = self.proposals(req, budget - 1)
        if proposals and allocate_slots(req.req_id, num_done, 1 + len(proposals)) is not None:
            return proposals
        return ()

    def verify_seq(
        self,
        req: Request,
        start: int,
        proposals: tuple[int, ...],
        block_table: Callable[[str], tuple[int, ...]],
    ) -> ScheduledSeq:
        """The step's share for a speculating request: its newest token, then proposals."""
        return ScheduledSeq(
            req.req_id,
            (req.all_token_ids[start], *proposals),
            start,
            block_table(req.req_id),
            True,
            req.sampling,
            req.seed,
            len(proposals),
            self.draft_context(req, start),
        )

    def keep_verified(
        self,
        seq: ScheduledSeq,
        req: Request,
        verified: int | tuple[int, ...],
        kv: KVCacheManager,
    ) -> tuple[tuple[int, ...], FinishReason | None]:
        """Apply a verifying step to the request. `verified` is what the runner kept
        (`accepted_prefix`: the accepted proposals, then the sampler's next token); up
        to a stop inside that run (nothing after it is kept) they become outputs and
        computed tokens, and the slots of rejected proposals go back to the pool.
        Returns the kept tokens and the stop, if any (the caller finishes the request)."""
        kept = (verified,) if isinstance(verified, int) else verified
        num_proposals = seq.num_draft_tokens
        num_accepted = len(kept) - 1
        req.num_inflight_tokens -= len(seq.token_ids)
        reason = None
        for i, token in enumerate(kept):
            if i == 0:  # the step's placeholder
                req.set_output_token(seq.start_position + 1, token)
            else:
                req.append_output_token(token)
            reason = req.check_stop(req.num_output_tokens)
            if reason is not None:
                kept = kept[: i + 1]
                break
        req.num_computed_tokens = seq.start_position + len(kept)
        kv.cache_full_blocks(req.req_id, req.all_token_ids, req.num_computed_tokens)
        kv.free_tail(req.req_id, req.num_tokens)
        self._verified(req, seq.start_position, num_proposals, num_accepted, len(kept))
        return kept, reason

    def _verified(
        self, req: Request, start: int, num_proposals: int, num_accepted: int, num_kept: int
    ) -> None:
        """Book a verification: `num_accepted` of `num_proposals` proposals matched, and
        the request kept `num_kept` new tokens (fewer after a stop inside the run)."""
        counters = self.counters
        counters.num_draft_tokens += num_proposals
        counters.num_accepted_tokens += num_accepted
        counters.num_verifications += 1
        if self.config.uses_draft_model:
            # The draft model ran on the proposals but the last: its KV holds them up to
            # there, and is right only as far as they were kept.
            self._state(req).num_draft_computed = min(start + num_proposals, start + num_kept)

    def _state(self, req: Request) -> SpecState:
        state = req.spec_state
        if state is None or state.num_preemptions != req.num_preemptions:
            ngram = state.ngram if state is not None else None  # tokens never change
            state = req.spec_state = SpecState(ngram, 0, req.num_preemptions)
        return state


def spec_stats(speculator: Speculator | None) -> dict[str, int]:
    """The engine's speculation counters as WorkerStats fields (zeros without it)."""
    counters = speculator.counters if speculator is not None else SpecCounters()
    return {
        "spec_draft_tokens": counters.num_draft_tokens,
        "spec_accepted_tokens": counters.num_accepted_tokens,
        "spec_verifications": counters.num_verifications,
    }
