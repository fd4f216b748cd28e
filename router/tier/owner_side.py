"""What the fleet owner adds to its own serving when it runs a router tier.

`router/service.py` calls these around what it does without a tier: `TierOwner.start`
as soon as it knows the workers' call token (the other processes start and import what
they need while the pools start), `OwnerSide` once the pools are up (the shared
admission, this process's name on the workers), `start` once its serving core runs (the
membership feed, the admin socket the others forward to, the drain hook that waits for
their requests, and the wait until they listen), and `stop` before the workers stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any

from engine.wire import PoolName
from router.fleet.clients import WorkerDied
from router.tier.admin_proxy import serve_owner_admin
from router.tier.membership import PUBLISH_EVERY_S, membership_of
from router.tier.messages import LinkPeers, PeersLinked
from router.tier.owner import TierOwner, consumer_name
from router.tier.rebalance import TierRebalancer
from router.tier.shared_admission import SharedAdmission
from router.tier.shared_load import LoadSharing
from router.tier.signals_relay import TierPlannerView, TierSignals

if TYPE_CHECKING:
    import grpc

    from router.edge.admin import AdminServicer
    from router.fleet.pools import Pools, WorkerRef

log = logging.getLogger(__name__)

# How long the service waits for the other processes to listen before it turns SERVING.
LISTEN_WAIT_S = 120.0
# How long a drain waits for the other router processes' requests on the worker to be
# gone (each process moves its own; one that cannot move finishes there).
DRAIN_WAIT_S = 600.0
DRAIN_POLL_S = 0.1


class OwnerSide:
    """The owner's half of a router tier."""

    def __init__(self, tier: TierOwner, pools: Pools) -> None:
        config = tier.config
        self.config = config
        self.pools = pools
        self.tier = tier
        self.consumer = consumer_name(0)
        rc = config.router
        self.admission = SharedAdmission(
            self.tier.table,
            0,
            rc.max_in_flight,
            rc.max_queue,
            policy=rc.admission_policy,
            aging_s=rc.priority_aging_s,
        )
        # This process's calls carry its name, so each decode worker sends it only the
        # updates of its own requests; a worker started later gets the same.
        for ref in pools.all():
            self._name_client(ref)
        pools.on_live.insert(0, self._name_client)
        LoadSharing(tier.load_table, 0).follow(pools)
        self._publisher: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._admin_server: grpc.aio.Server | None = None
        self.signals: TierSignals | None = None
        self._rebalancer: TierRebalancer | None = None
        # The other processes' moves off each draining worker (by id(ref)), under way.
        self._others_moving: dict[int, asyncio.Future[Any]] = {}

    def _name_client(self, ref: WorkerRef) -> None:
        client: Any = ref.client
        client.consumer = self.consumer
        client.grace_s = self.config.resume_grace_s

    def planner_core(self, core: Any) -> TierPlannerView:
        """What the planner reads: every process's traffic, not this one's alone."""
        self.signals = TierSignals(core.signals)
        self.tier.on_report.append(self.signals.absorb)
        return TierPlannerView(core, self.signals)

    async def start(self, core: Any, admin: AdminServicer) -> None:
        # First of the drain hooks: the other processes move their requests off the
        # worker while this one moves its own; the last waits for theirs to be gone.
        self.pools.drain_hooks.insert(0, self._others_move_theirs)
        self.pools.drain_hooks.append(self._wait_for_other_processes)
        self.tier.on_link_request = lambda index, asked: self._spawn(
            self._link_for(core, index, asked)
        )
        if core.live_migration is not None:
            self._rebalancer = TierRebalancer(core.live_migration, self.tier)
            admin.rebalancer = self._rebalancer
        self._admin_server = await serve_owner_admin(admin, self.tier.admin_address)
        self.tier.publish(membership_of(self.pools, core.prefill_policy))
        self._publisher = asyncio.ensure_future(self._publish(core))
        await self.tier.wait_listening(LISTEN_WAIT_S)

    async def _publish(self, core: Any) -> None:
        while True:
            await asyncio.sleep(PUBLISH_EVERY_S)
            self.tier.publish(membership_of(self.pools, core.prefill_policy))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _others_move_theirs(self, ref: WorkerRef) -> None:
        """Start the other processes' moves; `_wait_for_other_processes` awaits them."""
        if ref.pool is PoolName.DECODE and self._rebalancer is not None:
            moving = asyncio.ensure_future(self._rebalancer.drain_others(ref))
            self._others_moving[id(ref)] = moving
            # Gone once over, whether or not the wait below ran (a hook between failed).
            moving.add_done_callback(lambda _: self._others_moving.pop(id(ref), None))

    async def _link_for(self, core: Any, index: int, asked: LinkPeers) -> None:
        """Make the channel another process needs to move its requests (once per pair
        of incarnations, shared with this process's own moves), and answer it."""
        by_key = {(w.worker_id, w.info.epoch): w for w in self.pools.all()}
        sender, receiver = by_key.get(asked.sender), by_key.get(asked.receiver)
        error = None
        if sender is None or receiver is None:
            error = "a worker of that incarnation is not in the fleet"
        elif core.live_migration is None:
            error = "the service has no decode workers to move requests between"
        else:
            try:
                await core.live_migration.links.link(sender, receiver)
            except Exception as exc:  # noqa: BLE001 - the asker moves by recompute
                error = str(exc) or repr(exc)
        self.tier.tell(PeersLinked(asked.seq, error), index)

    async def _wait_for_other_processes(self, ref: WorkerRef) -> None:
        """A draining worker leaves once the other processes' requests on it are gone:
        each process has answered that its moves are over (a detached request is off the
        worker's queues before its KV is sent, over a channel the worker's leaving would
        close), and what could not move has finished there (the owner's own are counted
        by `Pools.drain`)."""
        moving = self._others_moving.pop(id(ref), None)
        if moving is not None:
            with contextlib.suppress(Exception):
                await moving
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DRAIN_WAIT_S
        while ref.state == "draining" and loop.time() < deadline:
            try:
                stats = await ref.client.load()
            except WorkerDied:
                return
            if stats.num_running + stats.num_waiting <= max(ref.num_assigned, 0):
                return
            await asyncio.sleep(DRAIN_POLL_S)

    async def stop(self) -> None:
        """Stop feeding the other processes (`TierOwner.stop` then stops them)."""
        if self._publisher is not None:
            self._publisher.cancel()
        if self._admin_server is not None:
            with contextlib.suppress(Exception):
                await self._admin_server.stop(0)
