"""A router process's read-only view of the fleet the owner runs.

It has what the serving core reads of `router.fleet.pools.Pools` (the workers by pool,
their states and peers, the targets, the hooks for a worker going live, dying or
leaving) and nothing that changes the fleet: no spawning, scaling or draining (a KV
channel between decode workers, for moving this process's requests off a draining one,
is asked of the owner, which makes them all). Each
`Membership` snapshot from the owner updates it: a worker new to it gets a client of
this process's own (its own connection to the worker, calls named as this process's),
one that went live is announced (the token delivery follows it), and one no longer
listed has left: its requests here are told it is lost (they migrate as with any lost
worker) and it is removed. A call that finds a worker dead (`mark_dead`) does the same
at once; the owner, which watches every worker through Ray, replaces it.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from engine.wire import POOLS, PoolName, WorkerInfo
from router.fleet.clients import DirectWorkerClient
from router.fleet.worker_ref import WorkerRef
from router.fleet.worker_state import WorkerState
from router.serving import workers
from router.tier.membership import Membership

log = logging.getLogger(__name__)

# Asks the owner for the channel sender → receiver, each named by (worker id, epoch).
LinkAsker = Callable[[tuple[str, int], tuple[str, int]], Awaitable[None]]


class PoolsView:
    """`Pools`' reading side, fed by the owner's membership snapshots."""

    def __init__(
        self,
        call_token: bytes,
        consumer: str,
        grace_s: float,
        cluster: Any = None,
        ask_link: LinkAsker | None = None,
    ) -> None:
        self._token = call_token
        self._ask_link = ask_link
        self._consumer = consumer
        self._grace_s = grace_s
        self.cluster = cluster  # what the serving core may read of it (use_gpus)
        self.workers: dict[str, list[WorkerRef]] = {pool: [] for pool in POOLS}
        self.targets: dict[str, int] = dict.fromkeys(POOLS, 0)
        self.on_death: list[Callable[[WorkerRef, str], None]] = []
        self.on_removed: list[Callable[[WorkerRef], None]] = []
        self.on_live: list[Callable[[WorkerRef], None]] = []
        # Never run here (draining is the owner's), kept for the serving core's hooks.
        self.drain_hooks: list[Callable[[WorkerRef], Awaitable[None]]] = []
        self.num_restarts = 0
        self._by_key: dict[tuple[str, int], WorkerRef] = {}
        self._dead: set[tuple[str, int]] = set()  # incarnations found dead here
        self.membership: Membership | None = None

    # ---------------------------------------------------------------- what Pools offers
    def routable(self, pool: str) -> list[WorkerRef]:
        return [w for w in self.workers[pool] if w.alive]

    def all(self) -> list[WorkerRef]:
        return [w for pool in POOLS for w in self.workers[pool]]

    def find(self, worker_id: str) -> WorkerRef | None:
        return next((w for w in self.all() if w.worker_id == worker_id), None)

    def num_starting(self, pool: str) -> int:
        return sum(1 for w in self.workers[pool] if w.state == "starting")

    def startup_s(self, pool: str) -> float | None:
        return None  # the planner runs in the owner

    @property
    def reference(self) -> WorkerInfo | None:
        refs = self.all()
        return refs[0].info if refs else None

    def incarnation(self, worker_id: str, epoch: int) -> WorkerRef | None:
        """The worker of that id and epoch, if this view has it."""
        return self._by_key.get((worker_id, epoch))

    async def link_peers(self, sender: workers.WorkerRef, receiver: workers.WorkerRef) -> None:
        if self._ask_link is None:
            raise RuntimeError("no fleet owner to make a channel between decode workers")
        await self._ask_link(_key(sender.info), _key(receiver.info))

    async def unlink_peers(self, peer: workers.WorkerRef, gone_id: str) -> None:
        """The owner's own peer links drop the channels of a worker that left."""

    def mark_dead(self, ref: workers.WorkerRef, reason: str) -> None:
        """A call found the worker gone: its requests here move on; the owner, which
        watches it through Ray, starts its replacement. (`ref` is one of this view's
        own, handed back by the serving core.)"""
        assert isinstance(ref, WorkerRef)
        if ref.state in ("dead", "gone"):
            return
        self._dead.add(_key(ref.info))
        self._drop(ref, reason, died=True)

    # ---------------------------------------------------------------- snapshots
    def apply(self, membership: Membership) -> None:
        """Bring the view to the owner's snapshot."""
        self.membership = membership
        self.targets.update(dict(membership.targets))
        listed: set[tuple[str, int]] = set()
        went_live: list[WorkerRef] = []
        for entry in membership.workers:
            key = _key(entry.info)
            listed.add(key)
            if key in self._dead:
                continue
            ref = self._by_key.get(key)
            if ref is None:
                ref = self._add(entry.info, WorkerState(entry.state))
                if entry.state == "live":
                    went_live.append(ref)
            elif ref.state != entry.state:
                if ref.state == "starting" and entry.state == "live":
                    went_live.append(ref)
                ref.state = WorkerState(entry.state)
            ref.peers = set(entry.peers)
        for key, ref in list(self._by_key.items()):
            if key not in listed:
                self._drop(ref, f"{ref.worker_id} left the fleet", died=True)
        self._dead &= listed  # forget incarnations the owner no longer lists
        for ref in went_live:
            log.info("%s live here", ref.worker_id)
            for callback in self.on_live:
                callback(ref)

    def _add(self, info: WorkerInfo, state: WorkerState) -> WorkerRef:
        client = DirectWorkerClient(info.call_address, self._token)
        client.consumer = self._consumer
        client.grace_s = self._grace_s
        ref = WorkerRef(
            PoolName(info.pool), info.index, None, info, state=state, client_impl=client
        )
        self.workers[info.pool].append(ref)
        self._by_key[_key(info)] = ref
        return ref

    def _drop(self, ref: WorkerRef, reason: str, died: bool) -> None:
        was = ref.state
        ref.state = WorkerState.DEAD if died else WorkerState.GONE
        self._by_key.pop(_key(ref.info), None)
        if died and was != "starting":
            log.warning("%s", reason)
            for death in self.on_death:
                death(ref, reason)
        if ref in self.workers[ref.pool]:
            self.workers[ref.pool].remove(ref)
            for removed in self.on_removed:
                removed(ref)
        if isinstance(ref.client_impl, DirectWorkerClient):
            ref.client_impl.close()


def _key(info: WorkerInfo) -> tuple[str, int]:
    return info.worker_id, info.epoch
