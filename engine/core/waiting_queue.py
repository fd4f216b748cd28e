"""The one waiting queue: the engine scheduler's and the router's admission queue.

Two policies, spelled the same everywhere:
* `fcfs`: first come, first served (by arrival);
* `priority`: lower `priority` value first, then arrival. A request's effective
  priority is its priority minus one level for every `aging_interval_s` seconds it has
  spent waiting, so a steady stream of urgent requests cannot starve a less urgent one
  forever. Only time in the queue counts; a request that left it (running) keeps the
  effective priority it was admitted with. So a preempted request always ranks behind
  the request that preempted it and cannot bounce it straight back, yet it keeps
  gaining a level per interval while it waits again.

Within one priority, an item pushed with a lower `tier` goes first (the decode pool's
imported requests, whose KV already holds blocks, go ahead of prompts).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Generic, Literal, Protocol, TypeVar

QueuePolicy = Literal["fcfs", "priority"]
QUEUE_POLICIES: tuple[QueuePolicy, ...] = ("fcfs", "priority")


class Queued(Protocol):
    """What the queue ranks an item by."""

    @property
    def req_id(self) -> str: ...
    @property
    def priority(self) -> int: ...
    @property
    def arrival_time(self) -> float: ...


Q = TypeVar("Q", bound=Queued)


class PriorityAging:
    """Wait time per request and the effective priority it earns; inert when off."""

    def __init__(
        self, aging_interval_s: float, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.aging_interval_s = aging_interval_s
        self.clock = clock
        self._waited_s: dict[str, float] = {}  # finished waiting periods
        self._waiting_since: dict[str, float] = {}

    @property
    def enabled(self) -> bool:
        return self.aging_interval_s > 0

    def start_waiting(self, req_id: str) -> None:
        if self.enabled:
            self._waiting_since[req_id] = self.clock()

    def stop_waiting(self, req_id: str) -> None:
        since = self._waiting_since.pop(req_id, None)
        if since is not None:
            self._waited_s[req_id] = self._waited_s.get(req_id, 0.0) + self.clock() - since

    def forget(self, req_id: str) -> None:
        self._waited_s.pop(req_id, None)
        self._waiting_since.pop(req_id, None)

    def waited_s(self, req_id: str) -> float:
        """Seconds the request has spent waiting, over all its waiting periods."""
        since = self._waiting_since.get(req_id)
        ongoing = 0.0 if since is None else self.clock() - since
        return self._waited_s.get(req_id, 0.0) + ongoing

    def effective_priority(self, item: Queued) -> int:
        """The priority the request is ranked by now (lower = more urgent)."""
        if not self.enabled:
            return item.priority
        return item.priority - int(self.waited_s(item.req_id) // self.aging_interval_s)


class WaitingQueue(Generic[Q]):
    """Items in policy order. Plain Python, not thread-safe: one owner drives it.

    The queue remembers how long each id has waited until `forget(req_id)`, so an item
    that left it keeps its effective priority (`effective_priority`)."""

    def __init__(
        self,
        policy: QueuePolicy = "fcfs",
        aging_interval_s: float = 0.0,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if policy not in QUEUE_POLICIES:
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {policy!r}")
        if aging_interval_s < 0:
            raise ValueError(
                f"the aging interval must be >= 0 (0 = no aging), got {aging_interval_s}"
            )
        self.policy = policy
        self.aging = PriorityAging(aging_interval_s if policy == "priority" else 0, clock=clock)
        self._items: list[Q] = []
        self._tiers: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __contains__(self, item: Q) -> bool:
        return item.req_id in self._tiers

    def __iter__(self) -> Iterator[Q]:
        """The items, first to be served first."""
        return iter(self._items)

    def key(self, item: Q) -> tuple[float, ...]:
        """Where the item ranks now (smaller first)."""
        tier = self._tiers.get(item.req_id, 0)
        if self.policy == "priority":
            return (self.aging.effective_priority(item), tier, item.arrival_time)
        return (tier, item.arrival_time)

    def effective_priority(self, item: Q) -> int:
        """The priority the item is ranked by now, waiting or not (lower = more urgent)."""
        return self.aging.effective_priority(item)

    def push(self, item: Q, tier: int = 0) -> None:
        """Start (or resume) waiting. A preempted request keeps its arrival time, so
        under fcfs it resumes ahead of newcomers."""
        self.aging.start_waiting(item.req_id)
        self._tiers[item.req_id] = tier
        key = self.key(item)
        idx = len(self._items)
        while idx > 0 and self.key(self._items[idx - 1]) > key:
            idx -= 1
        self._items.insert(idx, item)

    def reorder(self) -> None:
        """Apply the time waited since the last call (aging moves items up)."""
        if self.aging.enabled:
            self._items.sort(key=self.key)  # stable: equal keys keep their order

    def first(self) -> Q:
        """The item to be served next (the queue must not be empty)."""
        return self._items[0]

    def pop_first(self) -> Q:
        """Serve the first item: it stops waiting."""
        item = self._items.pop(0)
        self._left(item)
        return item

    def remove(self, item: Q) -> None:
        """Take a waiting item out (it stops waiting; its waited time is kept)."""
        self._items.remove(item)
        self._left(item)

    def forget(self, req_id: str) -> None:
        """The id is done with: drop what the queue remembers of it."""
        self.aging.forget(req_id)

    def _left(self, item: Q) -> None:
        self.aging.stop_waiting(item.req_id)
        self._tiers.pop(item.req_id, None)
