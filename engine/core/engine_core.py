"""The engine core: one step loop, `schedule() -> execute(batch) -> update(outputs)`.

With `async_scheduling` the loop runs one step ahead: it schedules and launches step
N+1 while the device still computes step N, then applies step N's tokens. The host's
scheduling, batch preparation and output handling hide behind the device's work
instead of adding to it. A decode of step N+1 whose input is step N's token gets it on
the device (the runner keeps it); the scheduler holds a placeholder until it is known.
A request that stops at step N has a step N+1 computed for nothing, which is dropped;
a length stop is known in advance and never costs one.

A step that speculates (engine.spec.speculation) runs with every token known: the loop
first applies the step in flight, and the verifying step itself is finished before the
next is scheduled (where the next starts depends on how many proposals it keeps).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Protocol

from engine.core.batch import Batch
from engine.core.config import CacheConfig, SchedulerConfig
from engine.core.request import PLACEHOLDER_TOKEN, FinishReason, Request, RequestStatus
from engine.core.role import EngineRole
from engine.core.scheduler import Scheduler
from engine.core.validation import validate_prompt
from engine.sampling_params import MAX_SEED
from engine.spec.spec_config import MAX_SPECULATIVE_TOKENS, SpeculativeConfig
from engine.spec.speculation import spec_stats
from engine.wire import (
    DetachedRequest,
    GenerationInput,
    KVEvents,
    PoolName,
    TokenUpdate,
    WorkerStats,
)

# A step's sampled tokens by request: one token, or for a sequence with proposals
# (ScheduledSeq.num_draft_tokens) the tokens verification kept: the proposals the
# sampler agreed with, then the sampler's own next token (speculation.accepted_prefix).
StepTokens = Mapping[str, int | tuple[int, ...]]


class Runner(Protocol):
    """What the engine needs from a model runner (the real one or a test double)."""

    def execute(self, batch: Batch) -> StepTokens: ...


class PendingTokens(Protocol):
    """A launched step's sampled tokens; `result()` waits for them."""

    def result(self) -> StepTokens: ...


class AsyncRunner(Runner, Protocol):
    """A runner that can launch a step without waiting for it (async scheduling).

    `launch` must feed a sequence whose input token is PLACEHOLDER_TOKEN with the token
    it sampled for that request in the step it launched last.
    """

    def launch(self, batch: Batch) -> PendingTokens: ...


class EngineCore:
    """Validates and admits requests, then advances all of them one step at a time.

    Not thread-safe: callers serialise add/abort/step (the async loop does).
    """

    def __init__(
        self,
        runner: Runner,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        *,
        max_model_len: int,
        vocab_size: int,
        eos_token_ids: frozenset[int] = frozenset(),
        role: EngineRole = EngineRole.COLOCATED,
        index: int = 0,
        async_scheduling: bool = False,
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        if async_scheduling and not callable(getattr(runner, "launch", None)):
            raise ValueError("async scheduling needs a runner that can launch a step (launch)")
        self.runner = runner
        self.role = role
        self.index = index  # which engine of its pool this is, as its stats name it
        self.async_scheduling = async_scheduling
        # Async scheduling: the step launched last, whose results are not applied yet.
        self._in_flight: tuple[Batch, PendingTokens] | None = None
        self.scheduler = Scheduler(
            scheduler_config,
            cache_config,
            role=role,
            async_scheduling=async_scheduling,
            speculative=speculative,
        )
        self.cache_config = cache_config
        self.speculative = speculative
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._rng = random.Random()

    def make_request(self, inp: GenerationInput, *, validate: bool = True) -> Request:
        """Turn an input into engine state, validating it first unless the caller's edge
        (the router) already did (raises ValueError)."""
        if validate:
            validate_prompt(
                inp.prompt_token_ids,
                inp.sampling,
                max_model_len=self.max_model_len,
                vocab_size=self.vocab_size,
                max_cache_tokens=self.cache_config.num_token_slots,
            )
        seed = inp.sampling.seed
        if seed is None:
            seed = self._rng.randint(0, MAX_SEED)
        return Request(
            req_id=inp.req_id,
            all_token_ids=list(inp.prompt_token_ids),
            num_prompt_tokens=len(inp.prompt_token_ids),
            sampling=inp.sampling,
            seed=seed,
            eos_token_ids=self.eos_token_ids,
            priority=inp.priority,
            max_model_len=self.max_model_len,
        )

    def add_request(self, inp: GenerationInput, *, validate: bool = True) -> Request:
        """Validate (unless the edge did) and queue a request."""
        req = self.make_request(inp, validate=validate)
        self.scheduler.add_request(req)
        return req

    # ---------------------------------------------------------------- KV ownership verbs
    def reserve(self, req_id: str, num_tokens: int) -> list[int] | None:
        """Hold blocks for num_tokens of incoming KV; None when they do not fit now."""
        return self.scheduler.reserve(req_id, num_tokens)

    def resize_reservation(self, req_id: str, num_tokens: int) -> list[int] | None:
        """Make a reservation hold num_tokens of KV, its leading blocks kept; its blocks,
        or None when it is not held or cannot grow now."""
        return self.scheduler.resize_reservation(req_id, num_tokens)

    def full_kv_blocks(self, req_id: str) -> list[int]:
        """The blocks of a running request whose KV is complete: every block full of
        computed tokens, which later steps never write (none when it is not running)."""
        req = self.scheduler.requests.get(req_id)
        if req is None or req.status is not RequestStatus.RUNNING:
            return []
        # A verifying step in flight may write proposals' KV that the next step then
        # rewrites: the tokens it may reach back over count as not computed.
        settled = req.num_computed_tokens - (1 + MAX_SPECULATIVE_TOKENS if self.speculative else 0)
        return self.block_ids(req_id)[: max(0, settled) // self.cache_config.block_size]

    def release(self, req_id: str) -> None:
        """Free blocks held outside the queues: a reservation, or KV kept for a hand-off."""
        self.scheduler.release(req_id)

    def block_ids(self, req_id: str) -> list[int]:
        """The blocks a request holds, in order."""
        return self.scheduler.kv.block_ids(req_id)

    def admit_imported(self, inp: GenerationInput, first_token: int) -> None:
        """Queue a request whose prompt KV was imported into its reserved blocks: it
        continues after `first_token`, exactly where the prefill engine stopped, once
        the scheduler gives it a slot (it holds its blocks until then)."""
        req = self.make_request(inp, validate=False)
        req.append_output_token(first_token)
        req.num_computed_tokens = len(inp.prompt_token_ids)
        self.scheduler.add_imported(req)

    def detach(self, req_id: str) -> DetachedRequest | None:
        """Take a running request out of the schedule, keeping its blocks (to send its KV
        elsewhere; `release` frees them). None when it is not running with all but its
        last token computed (finished, queued, or mid-recompute): it stays as it is.
        A step already launched for it (scheduling one step ahead) is dropped on
        arrival; its token is sampled again where the request continues, identically."""
        req = self.scheduler.requests.get(req_id)
        if req is None or req.status is not RequestStatus.RUNNING:
            return None
        known = len(req.all_token_ids)
        while known and req.all_token_ids[known - 1] == PLACEHOLDER_TOKEN:
            known -= 1
        if known - req.num_computed_tokens != 1:
            return None
        req.drop_placeholders()
        self.scheduler.finish_request(req_id, None, hand_off=True)
        return DetachedRequest(tuple(req.all_token_ids), req.num_computed_tokens)

    def stats(self) -> WorkerStats:
        """Occupancy and counters of this engine's cache and queues, as its worker
        reports them (named by the engine's pool and index)."""
        sched = self.scheduler
        return WorkerStats(
            pool=PoolName(self.role.value),
            index=self.index,
            num_blocks_total=sched.kv.pool.num_blocks,
            num_blocks_in_use=sched.kv.num_blocks_in_use,
            num_running=sched.num_running,
            num_waiting=sched.num_waiting,
            prefix_hit_tokens=sched.kv.stats.hit_tokens,
            prefix_query_tokens=sched.kv.stats.query_tokens,
            num_preemptions=sched.num_preemptions,
            **spec_stats(sched.speculator),
        )

    def abort(self, req_id: str) -> None:
        """End a request in any state and free its blocks; unknown ids are ignored."""
        self.scheduler.finish_request(req_id, FinishReason.ABORT)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or self._in_flight is not None

    def take_kv_events(self) -> KVEvents:
        """Prefix-cache changes since the last call, for a cache-aware router."""
        return self.scheduler.kv.take_kv_events()

    def kv_snapshot(self) -> KVEvents:
        """Every hash the prefix cache holds, as a full batch (for a router process that
        starts reading this engine's events), leaving the pending changes for the others."""
        return KVEvents(stored=self.scheduler.kv.pool.cached_hashes(), full=True)

    def step(self) -> list[TokenUpdate]:
        """Run one iteration; returns the new tokens and finishes it produced (with async
        scheduling: those of the step before, while this one runs on the device)."""
        sched = self.scheduler
        if (
            self._in_flight is not None
            and sched.wants_speculation
            and not sched.speculator.proposes_ahead  # type: ignore[union-attr]
        ):
            # A draft model proposes from the newest token: settle the step in flight.
            settled, self._in_flight = self._in_flight, None
            return sched.update(settled[0], settled[1].result())
        batch = sched.schedule()
        if not self.async_scheduling:
            if batch.is_empty:
                return []
            return sched.update(batch, self.runner.execute(batch))
        runner: AsyncRunner = self.runner  # type: ignore[assignment]  # checked in __init__
        if batch.num_draft_tokens:
            # How many proposals survive decides the next step's input: a verifying step
            # is settled before anything else is scheduled. It is launched first, reading
            # its newest tokens on the device from the step in flight (if any).
            verifying = runner.launch(batch)
            updates: list[TokenUpdate] = []
            if self._in_flight is not None:
                settled, self._in_flight = self._in_flight, None
                updates = sched.update(settled[0], settled[1].result())
            return updates + sched.update(batch, verifying.result())
        launched = None if batch.is_empty else (batch, runner.launch(batch))
        previous, self._in_flight = self._in_flight, launched
        if previous is None:
            return []
        return sched.update(previous[0], previous[1].result())
