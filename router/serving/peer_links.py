"""The KV channels between decode workers that live migration moves requests over
(router/serving/live_migration.py): made once per pair of incarnations, at a drain or, with
`--decode-peer-channels eager`, as soon as both ends are live; dropped when either end
leaves. The channel is the same transfer interface as a prefill hand-off's, with the
draining worker as the sending end."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

from engine.wire import PoolName
from router.serving.workers import Pools, WorkerRef

log = logging.getLogger(__name__)

LINK_TIMEOUT_S = 60.0
_Link = tuple[WorkerRef, WorkerRef, "asyncio.Future[None]"]  # sender, receiver, made


class PeerLinks:
    """Channels between decode workers, by (sender, receiver) incarnations."""

    def __init__(self, pools: Pools, spawn: Callable[[Any], None], eager: bool) -> None:
        self.pools = pools
        self.spawn = spawn
        # (sender, receiver) incarnations whose channel is up or being made.
        self._links: dict[tuple[str, int, str, int], _Link] = {}
        pools.on_removed.append(self._forget)
        if eager:
            pools.on_live.append(self._link_ahead)
            live = pools.routable(PoolName.DECODE)  # the pools started before the router
            for sender, receiver in itertools.permutations(live, 2):
                spawn(self._link_quietly(sender, receiver))

    async def link(self, sender: WorkerRef, receiver: WorkerRef) -> None:
        """The channel sender → receiver, made once per pair of incarnations."""
        key = (sender.worker_id, sender.info.epoch, receiver.worker_id, receiver.info.epoch)
        link = self._links.get(key)
        if link is None or (link[2].done() and link[2].exception() is not None):
            made = asyncio.ensure_future(
                asyncio.wait_for(self.pools.link_peers(sender, receiver), LINK_TIMEOUT_S)
            )
            link = (sender, receiver, made)
            self._links[key] = link
        await asyncio.shield(link[2])

    def _link_ahead(self, ref: WorkerRef) -> None:
        """A decode worker is live: make its channels with every live peer, both ways,
        now, so that a drain pays no set-up (`--decode-peer-channels eager`)."""
        if ref.pool is not PoolName.DECODE:
            return
        for peer in self.pools.routable(PoolName.DECODE):
            if peer is not ref:
                self.spawn(self._link_quietly(ref, peer))
                self.spawn(self._link_quietly(peer, ref))

    async def _link_quietly(self, sender: WorkerRef, receiver: WorkerRef) -> None:
        started = time.perf_counter()
        try:
            await self.link(sender, receiver)
        except Exception as exc:  # noqa: BLE001 - a drain tries again
            log.warning(
                "channel %s → %s not made ahead: %s", sender.worker_id, receiver.worker_id, exc
            )
            return
        log.info(
            "channel %s → %s ready for live migration (%.0f ms)",
            sender.worker_id,
            receiver.worker_id,
            1e3 * (time.perf_counter() - started),
        )

    def _forget(self, ref: WorkerRef) -> None:
        """A worker left: the channels it had with peers go, and a live peer drops its
        end now (a dead worker's peer would otherwise find out only from a broken
        receive, which NCCL reports after a minute)."""
        for key, (sender, receiver, _) in list(self._links.items()):
            if ref not in (sender, receiver):
                continue
            del self._links[key]
            peer = receiver if ref is sender else sender
            if peer.state.serving:
                self.spawn(self.pools.unlink_peers(peer, ref.worker_id))
