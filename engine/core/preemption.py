"""Who gives way when a step does not fit: the scheduler's preemption.

A running request is preempted (its blocks freed, to recompute later) when the blocks
of a more urgent one's next tokens do not fit, or, under the priority policy, when a
more urgent waiting request finds no seat (`max_num_seqs`). The victim is the least
urgent (lowest priority, then latest arrival). With nothing running, a waiting import
gives its blocks back instead, so that the head of the queue can start.
"""

from __future__ import annotations

from engine.core.config import SchedulerConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request, RequestStatus
from engine.core.waiting_queue import WaitingQueue


class Preemption:
    """Mixin for the Scheduler: picking and preempting victims."""

    config: SchedulerConfig
    kv: KVCacheManager
    waiting: WaitingQueue[Request]
    running: list[Request]
    num_preemptions: int
    # Waiting requests whose KV was imported (they hold their blocks while they wait).
    _imported: set[str]
    # Requests preempted during the current schedule() call.
    _preempted_now: set[str]

    def _enqueue_waiting(self, req: Request) -> None:
        # Imported requests go ahead of prompts of the same priority.
        self.waiting.push(req, tier=0 if req.req_id in self._imported else 1)

    def _pick_victim(self, candidates: list[Request]) -> Request:
        # Lowest priority (largest value) first, then the latest arrival.
        urgency = self.waiting.effective_priority
        return max(candidates, key=lambda r: (urgency(r), r.arrival_time))

    def _preempt_for(self, req: Request, chunks: dict[str, int]) -> int | None:
        """Priority policy: make room for `req` by preempting the least urgent running
        request, if it is strictly less urgent than `req`. Returns the step budget the
        victim gave back, or None when there is no such victim."""
        if self.config.policy != "priority" or not self.running:
            return None
        victim = self._pick_victim(self.running)
        if self.waiting.effective_priority(victim) <= self.waiting.effective_priority(req):
            return None
        freed = chunks.pop(victim.req_id, 0)
        self._preempt(victim)
        return freed

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req.req_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_inflight_tokens = 0
        req.drop_placeholders()
        self._preempted_now.add(req.req_id)
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue_waiting(req)

    def _make_room(
        self, req: Request, done: int, num_new: int, chunks: dict[str, int], budget: int
    ) -> tuple[bool, int]:
        """Blocks for `req`'s next `num_new` tokens, preempting the least urgent running
        request (req itself, last) while they do not fit. Returns whether req got them,
        and the step budget with the preempted requests' chunks given back."""
        while self.kv.allocate_slots(req.req_id, done, num_new) is None:
            victim = self._pick_victim(self.running)
            if victim.req_id in chunks:
                budget += chunks.pop(victim.req_id)
            self._preempt(victim)
            if victim is req:
                return False, budget
        return True, budget

    def _return_imported_blocks(self) -> bool:
        """Nothing runs, so no block will come free, yet the head of the queue needs one:
        the least urgent waiting import gives its blocks back and will recompute (its
        blocks stay in the prefix cache until reused). False when there is none."""
        holders = [r for r in self.waiting if r.req_id in self._imported]
        if not holders:
            return False
        victim = self._pick_victim(holders)
        self.waiting.remove(victim)
        self._imported.discard(victim.req_id)
        self.kv.free(victim.req_id)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue_waiting(victim)
        return True
