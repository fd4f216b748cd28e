"""Iteration-level scheduler: each call to `schedule()` decides one step for every request.

Plain Python, no torch. Prefill and decode are not modes: a request runs
`num_tokens - num_computed_tokens` tokens (capped by the budget and the chunk
threshold), so chunked prefill, decode and recompute after preemption share one path.
"""

from __future__ import annotations

from typing import NamedTuple

from engine.core.batch import Batch, ScheduledSeq
from engine.core.config import CacheConfig, SchedulerConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.priority import PriorityAging
from engine.core.request import FinishReason, Request, RequestStatus


class RequestUpdate(NamedTuple):
    """What one step did for one request: new tokens and, at the end, why it finished.
    (A NamedTuple: one is built per request per step.)"""

    req_id: str
    new_token_ids: tuple[int, ...]
    finish_reason: FinishReason | None
    num_cached_tokens: int = 0
    # The request left this engine with its blocks still allocated (prefill pool: they
    # hold the KV to hand off); whoever handles the update must release() them.
    kv_kept: bool = False


class Scheduler:
    """Owns the waiting and running queues and every request's blocks."""

    def __init__(
        self,
        config: SchedulerConfig,
        cache: CacheConfig,
        *,
        handoff_after_first_token: bool = False,
    ) -> None:
        self.config = config
        self.block_size = cache.block_size
        self.kv = KVCacheManager(cache.num_blocks, cache.block_size, config.enable_prefix_caching)
        # Prefill pool: a request leaves after its first token and keeps its blocks
        # until the worker has gathered them for the hand-off.
        self.handoff_after_first_token = handoff_after_first_token
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.aging = PriorityAging(config.priority_aging_s if config.policy == "priority" else 0)
        self.num_preemptions = 0  # since start, for metrics

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

    def _queue_key(self, req: Request) -> tuple[float, ...]:
        if self.config.policy == "priority":
            return (self.aging.effective_priority(req), req.arrival_time)
        return (req.arrival_time,)

    def _enqueue_waiting(self, req: Request) -> None:
        # Sorted insert keeps the queue in policy order; a preempted request keeps
        # its original arrival time, so under FCFS it resumes ahead of newcomers.
        self.aging.start_waiting(req.req_id)
        key = self._queue_key(req)
        idx = len(self.waiting)
        while idx > 0 and self._queue_key(self.waiting[idx - 1]) > key:
            idx -= 1
        self.waiting.insert(idx, req)

    def add_request(self, req: Request) -> None:
        """Queue a new request (its KV may already be present: see add_running)."""
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

    def add_running(self, req: Request) -> None:
        """Decode pool: admit a request whose KV was imported into its reserved blocks."""
        if req.req_id in self.requests:
            raise ValueError(f"request id {req.req_id!r} is already in use")
        if not self.kv.holds(req.req_id):
            raise ValueError(f"request {req.req_id!r} has no reserved blocks")
        self.requests[req.req_id] = req
        req.status = RequestStatus.RUNNING
        self.kv.cache_full_blocks(req.req_id, req.all_token_ids, req.num_computed_tokens)
        self.running.append(req)

    def release(self, req_id: str) -> None:
        """Free blocks held outside the queues (a reservation or a finished hand-off)."""
        if req_id not in self.requests:
            self.kv.free(req_id)

    def finish_request(
        self, req_id: str, reason: FinishReason | None, *, keep_blocks: bool = False
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
        self.aging.forget(req_id)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        if not keep_blocks:
            self.kv.free(req_id)
        return req

    # ---------------------------------------------------------------- schedule
    def _chunk(self, req: Request, budget: int) -> int:
        num_new = req.num_tokens - req.num_computed_tokens
        threshold = self.config.long_prefill_token_threshold
        if threshold > 0:
            num_new = min(num_new, threshold)
        return min(num_new, budget)

    def _pick_victim(self, candidates: list[Request]) -> Request:
        # Lowest priority (largest value) first, then the latest arrival.
        return max(candidates, key=lambda r: (self.aging.effective_priority(r), r.arrival_time))

    def _preempt_for(self, req: Request, chunks: dict[str, int]) -> int | None:
        """Priority policy: make room for `req` by preempting the least urgent running
        request, if it is strictly less urgent than `req`. Returns the step budget the
        victim gave back, or None when there is no such victim."""
        if self.config.policy != "priority" or not self.running:
            return None
        victim = self._pick_victim(self.running)
        if self.aging.effective_priority(victim) <= self.aging.effective_priority(req):
            return None
        freed = chunks.pop(victim.req_id, 0)
        self._preempt(victim)
        return freed

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req.req_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue_waiting(req)

    def schedule(self) -> Batch:
        """Pick this step's work under the token budget, the seq limit and free blocks."""
        budget = self.config.max_num_batched_tokens
        chunks: dict[str, int] = {}
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
        for req in list(self.running):
            if budget <= 0:
                break
            if req.status is not running_status or req.req_id in chunks:
                continue
            # _chunk(), inlined: this loop visits every running request every step.
            num_new = len(req.all_token_ids) - req.num_computed_tokens
            if 0 < threshold < num_new:
                num_new = threshold
            if num_new > budget:
                num_new = budget
            if num_new <= 0:
                continue
            while allocate_slots(req.req_id, req.num_computed_tokens, num_new) is None:
                victim = self._pick_victim(self.running)
                if victim.req_id in chunks:
                    budget += chunks.pop(victim.req_id)
                self._preempt(victim)
                if victim is req:
                    break
            else:
                chunks[req.req_id] = num_new
                budget -= num_new
        return budget

    def _schedule_waiting(self, chunks: dict[str, int], budget: int) -> int:
        if self.aging.enabled:
            self.waiting.sort(key=self._queue_key)  # waiting time reorders the queue
        while self.waiting and budget > 0:
            req = self.waiting[0]
            if len(self.running) >= self.config.max_num_seqs:
                freed = self._preempt_for(req, chunks)
                if freed is None:
                    break
                budget += freed
            is_new = req.status is RequestStatus.WAITING and req.num_computed_tokens == 0
            prefix = self.kv.find_cached_prefix(req.all_token_ids, req.block_hashes)
            num_hit = len(prefix) * self.block_size
            req.num_computed_tokens = num_hit
            num_new = self._chunk(req, budget)
            if self.kv.allocate_slots(req.req_id, num_hit, num_new, prefix) is None:
                req.num_computed_tokens = 0
                freed = self._preempt_for(req, chunks)
                if freed is None:
                    break  # head-of-line waits for blocks; running requests are never starved
                budget += freed
                continue
            if is_new:
                req.num_cached_tokens = num_hit
                self.kv.record_prefix_query(req.num_prompt_tokens, num_hit)
            self.waiting.pop(0)
            self.aging.stop_waiting(req.req_id)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            chunks[req.req_id] = num_new
            budget -= num_new
        return budget

    def _build_batch(self, chunks: dict[str, int]) -> Batch:
        seqs = []
        block_table = self.kv.block_table
        for req in self.running:
            num_new = chunks.get(req.req_id)
            if not num_new:
                continue
            tokens = req.all_token_ids
            start = req.num_computed_tokens
            end = start + num_new
            # Positional: this runs for every request every step.
            seqs.append(
                ScheduledSeq(
                    req.req_id,
                    (tokens[start],) if num_new == 1 else tuple(tokens[start:end]),
                    start,
                    block_table(req.req_id),
                    end == len(tokens),
                    req.sampling,
                    req.seed,
                )
            )
        return Batch(seqs=tuple(seqs), block_size=self.block_size)

    # ---------------------------------------------------------------- update
    def update(self, batch: Batch, sampled: dict[str, int]) -> list[RequestUpdate]:
        """Apply a step's results: progress, new tokens, stop checks, finishing."""
        updates: list[RequestUpdate] = []
        requests, running_status = self.requests, RequestStatus.RUNNING
        cache_full_blocks = self.kv.cache_full_blocks
        handoff = self.handoff_after_first_token
        for seq in batch.seqs:
            req_id = seq.req_id
            req = requests.get(req_id)
            if req is None or req.status is not running_status:
                continue  # aborted or preempted while the step ran
            req.num_computed_tokens += len(seq.token_ids)
            cache_full_blocks(req_id, req.all_token_ids, req.num_computed_tokens)
            if not seq.sample:
                continue
            token = sampled[req_id]
            req.append_output_token(token)
            reason = req.check_stop()
            kv_kept = reason is None and handoff
            if reason is not None or kv_kept:
                self.finish_request(req_id, reason, keep_blocks=kv_kept)
            updates.append(RequestUpdate(req_id, (token,), reason, req.num_cached_tokens, kv_kept))
        return updates
