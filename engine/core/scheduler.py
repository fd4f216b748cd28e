"""Iteration-level scheduler: each call to `schedule()` decides one step for every request.

Plain Python, no torch. Prefill and decode are not modes: a request runs the tokens
past `num_computed_tokens + num_inflight_tokens` (capped by the budget and the chunk
threshold), so chunked prefill, decode and recompute after preemption share one path.

`schedule()` counts what it hands out as in flight and, for a sequence that samples,
appends a placeholder token; `update()` turns in-flight tokens into computed ones and
fills the placeholder in. Called in turn (schedule, execute, update) that is the plain
step loop; the engine may also schedule step N+1 before applying step N's results
(engine.core.engine_core), and this bookkeeping is what lets it.

A request's life here: waiting (a new prompt, a preempted request, or, on a decode
worker, an imported one: its prompt KV already in its blocks) -> running -> finished.
Every waiting request, imported ones included, is admitted only under `max_num_seqs`;
who gives way when a step does not fit is engine.core.preemption's.
"""

from __future__ import annotations

from collections.abc import Mapping

from engine.core.batch import Batch, plain_seq
from engine.core.config import CacheConfig, SchedulerConfig
from engine.core.inflight import InflightBatches
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.preemption import Preemption
from engine.core.request import PLACEHOLDER_TOKEN, FinishReason, Request, RequestStatus
from engine.core.role import EngineRole
from engine.core.waiting_queue import WaitingQueue
from engine.spec.spec_config import SpeculativeConfig
from engine.spec.speculation import Speculator
from engine.wire import TokenUpdate, sampled_update


class Scheduler(Preemption):
    """Owns the waiting and running queues and every request's blocks."""

    def __init__(
        self,
        config: SchedulerConfig,
        cache: CacheConfig,
        *,
        role: EngineRole = EngineRole.COLOCATED,
        async_scheduling: bool = False,
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        self.config = config
        # Only engines that decode speculate (a prefill engine stops at the first token).
        self.speculator = Speculator(speculative) if speculative and role.decodes else None
        self._proposals: dict[str, tuple[int, ...]] = {}  # this step's, by request
        # Batches handed out and not yet updated: one may await its update() when the
        # engine schedules a step ahead.
        self.inflight = InflightBatches(1 if async_scheduling else 0)
        self.block_size = cache.block_size
        self.kv = KVCacheManager(cache.num_blocks, cache.block_size, config.enable_prefix_caching)
        self.role = role
        self.requests: dict[str, Request] = {}
        self.waiting: WaitingQueue[Request] = WaitingQueue(config.policy, config.priority_aging_s)
        # Waiting requests whose KV was imported (decode pool): they hold their blocks
        # while they wait for a slot and rank ahead of prompts of the same priority
        # (their prompt costs no compute; holding blocks idle helps nobody).
        self._imported: set[str] = set()
        self.running: list[Request] = []
        self.num_preemptions = 0  # since start, for metrics
        # Requests preempted during the current schedule() call: they are not admitted
        # again until the results of the steps they were in have been applied.
        self._preempted_now: set[str] = set()

    # ---------------------------------------------------------------- queues
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def wants_speculation(self) -> bool:
        """The next step would speculate: it needs every running token on the host."""
        spec = self.speculator
        return spec is not None and bool(self.running) and spec.speculates_at(len(self.running))

    def add_request(self, req: Request) -> None:
        """Queue a new request (one whose KV is already here: see add_imported)."""
        if req.req_id in self.requests:
            raise ValueError(f"request id {req.req_id!r} is already in use")
        self.requests[req.req_id] = req
        req.status = RequestStatus.WAITING
        self._enqueue_waiting(req)

    def reserve(self, req_id: str, num_tokens: int) -> list[int] | None:
        """Decode pool: hold blocks for an incoming hand-off before any byte moves."""
        if req_id in self.requests or self.kv.holds(req_id):
            raise ValueError(f"request id {req_id!r} already holds blocks here")
        return self.kv.allocate_slots(req_id, 0, num_tokens)

    def resize_reservation(self, req_id: str, num_tokens: int) -> list[int] | None:
        """Grow or shrink a reservation to hold num_tokens (its leading blocks stay); its
        blocks, or None when it is not held here or cannot grow now."""
        if req_id in self.requests or not self.kv.holds(req_id):
            return None
        if self.kv.allocate_slots(req_id, 0, num_tokens) is None:
            return None
        self.kv.free_tail(req_id, num_tokens)
        return self.kv.block_ids(req_id)

    def add_imported(self, req: Request) -> None:
        """Decode pool: queue a request whose KV was imported into its reserved blocks.

        It keeps those blocks while it waits and is admitted like any waiting request
        (under max_num_seqs, preempting a less urgent one under the priority policy),
        ahead of prompts of the same priority; an abort while it waits frees them.
        """
        if req.req_id in self.requests:
            raise ValueError(f"request id {req.req_id!r} is already in use")
        if not self.kv.holds(req.req_id):
            raise ValueError(f"request {req.req_id!r} has no reserved blocks")
        self.requests[req.req_id] = req
        req.status = RequestStatus.WAITING
        self.kv.cache_full_blocks(req.req_id, req.all_token_ids, req.num_computed_tokens)
        self._imported.add(req.req_id)
        self._enqueue_waiting(req)

    def release(self, req_id: str) -> None:
        """Free blocks held outside the queues (a reservation or a finished hand-off)."""
        if req_id not in self.requests:
            self.kv.free(req_id)

    def finish_request(
        self, req_id: str, reason: FinishReason | None, *, hand_off: bool = False
    ) -> Request | None:
        """End a request in any state (idempotent); its blocks return unless kept for a
        hand-off. Call between steps: the engine queues aborts until then."""
        req = self.requests.pop(req_id, None)
        if req is None:
            # Unknown, already finished, or blocks held for a hand-off or reservation:
            # those are released only by their owner through release().
            return None
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(req)
            self._imported.discard(req_id)
        self.waiting.forget(req_id)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        if not hand_off:
            self.kv.free(req_id)
        return req

    # ---------------------------------------------------------------- schedule
    def _chunk(self, req: Request, budget: int) -> int:
        num_new = req.num_tokens - req.num_computed_tokens
        threshold = self.config.long_prefill_token_threshold
        if threshold > 0:
            num_new = min(num_new, threshold)
        return min(num_new, budget)

    def schedule(self) -> Batch:
        """Pick this step's work under the token budget, the seq limit and free blocks."""
        self.inflight.roll_back_abandoned()
        budget = self.config.step_tokens
        chunks: dict[str, int] = {}
        self._preempted_now.clear()
        self._proposals.clear()
        if self.config.prioritize_prefill:
            budget = self._schedule_waiting(chunks, budget)
            budget = self._schedule_running(chunks, budget)
        else:
            budget = self._schedule_running(chunks, budget)
            budget = self._schedule_waiting(chunks, budget)
        return self._build_batch(chunks)

    def _schedule_running(self, chunks: dict[str, int], budget: int) -> int:
        running_status = RequestStatus.RUNNING
        allocate_slots = self.kv.allocate_slots
        threshold = self.config.long_prefill_token_threshold
        handoff = self.role.hands_off_after_first_token
        spec = self.speculator if self.wants_speculation else None
        tables, block_size = self.kv.block_tables, self.block_size
        for req in list(self.running):
            if budget <= 0:
                break
            if req.status is not running_status or req.req_id in chunks:
                continue
            done = req.num_computed_tokens
            num_tokens = len(req.all_token_ids)
            if req.num_inflight_tokens:
                done += req.num_inflight_tokens
                # A token still being sampled that will end the request (its length, or
                # the hand-off after a prefill): no step past it. (last_output_token and
                # num_output_tokens, inlined: with async scheduling every running request
                # has a token in flight here, every step.)
                num_outputs = num_tokens - req.num_prompt_tokens
                if (
                    num_outputs > 0
                    and req.all_token_ids[-1] == PLACEHOLDER_TOKEN
                    and (handoff or num_outputs >= req.max_outputs)  # req.length_stop
                ):
                    continue
            # _chunk(), inlined: this loop visits every running request every step.
            num_new = num_tokens - done
            if 0 < threshold < num_new:
                num_new = threshold
            if num_new > budget:
                num_new = budget
            if num_new <= 0:
                continue
            if spec is not None and num_tokens - done == 1:
                proposals = spec.plan(req, done, budget, allocate_slots)
                if proposals:  # their slots are allocated
                    self._proposals[req.req_id] = proposals
                    num_new += len(proposals)
            table = tables.get(req.req_id)
            if table is None or done + num_new > len(table) * block_size:
                # Its blocks are full (allocate_slots's first check, inlined: most decode
                # steps have room in the last block).
                fitted, budget = self._make_room(req, done, num_new, chunks, budget)
                if not fitted:
                    continue
            chunks[req.req_id] = num_new
            budget -= num_new
        return budget

    def _schedule_waiting(self, chunks: dict[str, int], budget: int) -> int:
        self.waiting.reorder()  # waiting time reorders the queue
        while self.waiting and budget > 0:
            req = self.waiting.first()
            if req.req_id in self._preempted_now:
                break  # back next step, once its in-flight step's results are applied
            if len(self.running) >= self.config.max_num_seqs:
                freed = self._preempt_for(req, chunks)
                if freed is None:
                    break
                budget += freed
            is_new = False
            if req.req_id in self._imported:  # its KV is here: only the next token to run
                num_new = self._chunk(req, budget)
                allocated = self.kv.allocate_slots(req.req_id, req.num_computed_tokens, num_new)
            else:
                is_new = req.status is RequestStatus.WAITING and req.num_computed_tokens == 0
                prefix = self.kv.find_cached_prefix(req.all_token_ids, req.block_hashes)
                num_hit = len(prefix) * self.block_size
                req.num_computed_tokens = num_hit
                num_new = self._chunk(req, budget)
                allocated = self.kv.allocate_slots(req.req_id, num_hit, num_new, prefix)
                if allocated is None:
                    req.num_computed_tokens = 0
            if allocated is None:
                freed = self._preempt_for(req, chunks)
                if freed is not None:
                    budget += freed
                    continue
                if not self.running and self._return_imported_blocks():
                    continue
                break  # head-of-line waits for blocks; running requests are never starved
            if is_new:
                req.num_cached_tokens = num_hit
                self.kv.record_prefix_query(req.num_prompt_tokens, num_hit)
            self.waiting.pop_first()
            self._imported.discard(req.req_id)
            req.start_running()
            self.running.append(req)
            chunks[req.req_id] = num_new
            budget -= num_new
        return budget

    def _build_batch(self, chunks: dict[str, int]) -> Batch:
        seqs = []
        reqs = []
        tables = self.kv.block_tables
        proposals, spec = self._proposals, self.speculator
        num_drafts = 0
        for req in self.running:
            num_new = chunks.get(req.req_id)
            if not num_new:
                continue
            tokens = req.all_token_ids
            start = req.num_computed_tokens + req.num_inflight_tokens
            end = start + num_new
            sample = end >= len(tokens)  # past the end: proposals to verify, then sampled
            if proposals and spec is not None and req.req_id in proposals:
                seqs.append(spec.verify_seq(req, start, proposals[req.req_id], self.kv.block_table))
                num_drafts += num_new - 1
            else:  # positional: this runs for every request every step
                seqs.append(
                    plain_seq(
                        req.req_id,
                        (tokens[start],) if num_new == 1 else tuple(tokens[start:end]),
                        start,
                        tables[req.req_id],
                        sample,
                        req.sampling,
                        req.seed,
                    )
                )
            reqs.append(req)
            req.num_inflight_tokens += num_new
            if sample:  # req.append_output_token, inlined
                tokens.append(PLACEHOLDER_TOKEN)
        batch = Batch(seqs=tuple(seqs), block_size=self.block_size, num_draft_tokens=num_drafts)
        if seqs:
            self.inflight.add(batch, tuple(reqs))
        return batch

    # ---------------------------------------------------------------- update
    def update(
        self, batch: Batch, sampled: Mapping[str, int | tuple[int, ...]]
    ) -> list[TokenUpdate]:
        """Apply a step's results: progress, new tokens, stop checks, finishing."""
        updates: list[TokenUpdate] = []
        running_status = RequestStatus.RUNNING
        cache_full_blocks = self.kv.cache_full_blocks
        block_size = self.block_size
        handoff = self.role.hands_off_after_first_token
        spec = self.speculator
        stop, length = FinishReason.STOP, FinishReason.LENGTH
        reqs = self.inflight.requests_of(batch, self.requests.get)
        for seq, req in zip(batch.seqs, reqs, strict=True):
            req_id = seq.req_id
            if req is None or req.status is not running_status:
                continue  # aborted or preempted while the step ran
            if seq.num_draft_tokens and spec is not None:
                kept, reason = spec.keep_verified(seq, req, sampled[req_id], self.kv)
                if reason is not None:
                    self.finish_request(req_id, reason)
                cached, scheduled_at = req.num_cached_tokens, req.scheduled_at
                updates.append(TokenUpdate(req_id, kept, reason, cached, scheduled_at=scheduled_at))
                continue
            num_new = len(seq.token_ids)
            computed = req.num_computed_tokens + num_new
            req.num_computed_tokens = computed
            req.num_inflight_tokens -= num_new
            tokens = req.all_token_ids
            # Full blocks are registered as they fill (and on import), so only a step
            # that filled one has any: most decode steps skip the call.
            if computed // block_size != (computed - num_new) // block_size:
                cache_full_blocks(req_id, tokens, computed)
            if not seq.sample:
                continue
            token: int = sampled[req_id]  # type: ignore[assignment]  # no proposals: one
            # seq.end_position, req.set_output_token and req.check_stop, inlined (every
            # request, every step; the sampled token is the newest output).
            position = seq.start_position + num_new
            tokens[position] = token
            if token in req.stop_ids:
                reason = stop
            elif position + 1 - req.num_prompt_tokens >= req.max_outputs:
                reason = length
            else:
                reason = None
            hand_off = reason is None and handoff
            if reason is not None or hand_off:
                self.finish_request(req_id, reason, hand_off=hand_off)
            updates.append(
                sampled_update(
                    req_id, token, reason, req.num_cached_tokens, hand_off, req.scheduled_at
                )
            )
        return updates
