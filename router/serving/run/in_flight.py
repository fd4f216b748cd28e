"""The attempts in flight, by the id their workers know them by: where a decode worker's
updates go (each attempt's inbox), what a lost worker takes with it, and what ending an
attempt undoes (its leases, its reservation's renewal, and, unless it finished, its
request on every worker it may have reached)."""

from __future__ import annotations

from engine.wire import PoolName
from router.serving.events import RequestObserver
from router.serving.inbox import UpdateInbox
from router.serving.interfaces import Aborts, Renewals
from router.serving.run.attempts import Attempt, ClientRequest, WorkerLost, continuation
from router.serving.workers import Pools, WorkerRef

PAIRED_POOLS = (PoolName.PREFILL, PoolName.DECODE)


class InFlight:
    """Every attempt in flight; `len()` is the requests streaming."""

    def __init__(
        self,
        pools: Pools,
        aborts: Aborts,
        renewals: Renewals,
        observer: RequestObserver,
        colocated_mode: bool,
    ) -> None:
        self.pools = pools
        self.aborts = aborts
        self.renewals = renewals
        self.observer = observer
        # Where an attempt's request may be: every worker of these pools, until known.
        self.pools_reached = (PoolName.COLOCATED,) if colocated_mode else PAIRED_POOLS
        self.by_id: dict[str, Attempt] = {}

    def __len__(self) -> int:
        return len(self.by_id)

    def inbox_of(self, req_id: str) -> UpdateInbox | None:
        attempt = self.by_id.get(req_id)
        return None if attempt is None else attempt.inbox

    def on_worker_death(self, ref: WorkerRef, reason: str) -> None:
        """The pools' death hook: every attempt decoding on `ref` is lost."""
        for attempt in list(self.by_id.values()):
            if attempt.decode_ref is ref:
                attempt.inbox.put(WorkerLost(reason, worker=ref))

    def begin(self, request: ClientRequest, number: int) -> Attempt:
        """Attempt `number` of `request`: itself, or a continuation after streamed tokens."""
        progress = request.progress
        attempt = Attempt(
            continuation(request.base, number, progress),
            request.request_id,
            number=number,
            resumes_after=progress.num_out,
        )
        self.by_id[attempt.req_id] = attempt
        self.observer.attempt_started(request, attempt)
        return attempt

    def end(self, attempt: Attempt, abort: bool = True) -> None:
        """Forget an attempt; abort it wherever it may still live (in the background:
        this may run while the request's stream closes on cancellation)."""
        if self.by_id.pop(attempt.req_id, None) is None:
            return
        self.observer.attempt_ended(attempt)
        for lease in attempt.leases:
            lease.release()
        if attempt.decode_ref is not None:
            self.renewals.release(attempt.decode_ref, attempt.req_id)
        if not abort:
            return
        known = [r for r in (attempt.prefill_ref, attempt.decode_ref) if r is not None]
        if len(known) == len(self.pools_reached):
            targets = known
        else:
            targets = [w for w in self.pools.all() if w.pool in self.pools_reached]
        for ref in targets:
            self.aborts.abort(ref, attempt.req_id)
