"""What the router counts of each worker's load, and the lease that keeps the count.

A request holds a `WorkerLease` on every worker it occupies, from the moment it is
routed there (so concurrent arrivals spread) until the worker is done with it; the
lease gives its count back exactly once, however the request ends. The estimates here
(prefill rate, decode step time, hand-off time) feed the local-prefill decision; they
start from what the worker measured as it warmed up (`assume`), so the decision holds
from the first request, and traffic's own measurements take over as they come.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Protocol

from engine.wire import EngineSpeed, WorkerStats
from router.routing.prefill_policy import Ewma, PrefillRate, StepWindow


class LoadShare(Protocol):
    """A router tier's cells for one worker (router/tier/shared_load.py): this process's
    counts, written for the others, and theirs."""

    def publish(self, num_assigned: int, queued_tokens: int) -> None: ...
    def others(self) -> tuple[int, int]: ...


@dataclass
class WorkerLoad:
    """The router's running account of one worker."""

    num_assigned: int = 0  # requests this router has in flight on it
    queued_tokens: int = 0  # uncached prompt tokens sent to it and not yet answered
    # In a router tier: what the other processes have there (None: there are none).
    share: LoadShare | None = None
    busy_since: float = 0.0  # when num_assigned last went from 0 to 1
    stats: WorkerStats | None = None  # the worker's last report (decode: every batch)
    prefill_rate: PrefillRate = field(default_factory=PrefillRate)
    step_s: StepWindow = field(default_factory=StepWindow)  # decode step time lately
    handoff_s: Ewma = field(default_factory=Ewma)  # hand-offs into this worker
    # A decode worker's own prompts: their compute phase per uncached token, lately.
    local_prefill_s_per_token: Ewma = field(default_factory=Ewma)
    last_batch_at: float | None = None
    speed: EngineSpeed | None = None  # what the worker's warm-up measured

    def assume(self, speed: EngineSpeed | None) -> None:
        """Start from the worker's warm-up: its prompt rate (a prefill worker's rate, the
        price of a prompt a decode worker runs itself) and its decode step time."""
        self.speed = speed
        if speed is not None:
            self.prefill_rate.tokens_per_s.assume(speed.prefill_tokens_per_s)
            self.local_prefill_s_per_token.assume(speed.prefill_s_per_token)

    def decode_step_s(self, now: float) -> float | None:
        """Its mean step time over the window (`StepWindow`); while requests run there
        and no step has fallen in the window yet (the first batch of a burst), the
        warm-up's step, a batch of one: a floor."""
        mean = self.step_s.mean(now)
        if mean is None and self.stats is not None and self.stats.num_running > 0:
            return self.speed.decode_step_s if self.speed is not None else None
        return mean

    @property
    def service_assigned(self) -> int:
        """Requests in flight on it from every router process: what routing weighs."""
        if self.share is None:
            return self.num_assigned
        return self.num_assigned + self.share.others()[0]

    @property
    def service_queued_tokens(self) -> int:
        """Queued prompt tokens sent to it by every router process."""
        if self.share is None:
            return self.queued_tokens
        return self.queued_tokens + self.share.others()[1]

    def changed(self) -> None:
        """The counts changed: tell the other router processes, if any."""
        if self.share is not None:
            self.share.publish(self.num_assigned, self.queued_tokens)

    def lease(self, num_tokens: int = 0, prices_local_prefill: bool = False) -> WorkerLease:
        return WorkerLease(self, num_tokens, prices_local_prefill)

    def observe_batch(self, num_steps: int, stats: WorkerStats | None, now: float) -> float | None:
        """A decode worker's token batch covering num_steps steps arrived; the step time
        it shows, if any."""
        if stats is not None:
            self.stats = stats
        last, self.last_batch_at = self.last_batch_at, now
        busy = stats is None or stats.num_running > 0
        if last is None or num_steps <= 0 or not busy:
            return None
        self.step_s.add(now, now - last, num_steps)
        return (now - last) / num_steps


class WorkerLease:
    """One request's share of a worker's load (an async context manager, or release()
    by hand when the request keeps it past a block)."""

    def __init__(
        self, load: WorkerLoad, num_tokens: int, prices_local_prefill: bool = False
    ) -> None:
        self._load = load
        self.num_tokens = num_tokens
        # A prompt the decode worker runs itself, long enough that its time per token
        # says what the next such prompt costs (a short one's is mostly fixed cost).
        self._prices_local_prefill = prices_local_prefill
        self.was_idle = load.num_assigned == 0
        if self.was_idle:
            load.busy_since = time.monotonic()
        load.num_assigned += 1
        load.queued_tokens += num_tokens
        load.changed()
        self._held = True

    @property
    def held(self) -> bool:
        return self._held

    def done_with_tokens(self, compute_s: float | None = None) -> None:
        """Its prompt tokens are no longer queued there (the prefill answered). With
        compute_s, the worker ran them itself in that time: a prompt that prices local
        prefill updates the load's rate."""
        if compute_s and self.num_tokens > 0 and self._prices_local_prefill:
            self._load.local_prefill_s_per_token.add(compute_s / self.num_tokens)
        if self.num_tokens:
            self._load.queued_tokens -= self.num_tokens
            self._load.changed()
        self.num_tokens = 0

    def release(self) -> None:
        """Give the count back (idempotent)."""
        if not self._held:
            return
        self._held = False
        self.done_with_tokens()
        self._load.num_assigned -= 1
        self._load.changed()

    async def __aenter__(self) -> WorkerLease:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()
