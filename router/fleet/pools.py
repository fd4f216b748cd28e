"""The live pools: which workers exist, which pairs are connected, restarts and scaling.

A worker's life, as the router sees it:
  starting → live (routable; channels to every live peer of the other pool)
           → draining (no new work; in-flight requests finish) → gone
  any state → dead (the actor died): its peers drop their channels, the requests on it
              end (retried where no token reached the client), and a replacement with
              the same id and a new epoch starts while the pool is below its target.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from ray.exceptions import RayActorError

from engine.wire import ChannelSpec, PoolName, WorkerInfo, epoch_hex
from router.fleet.clients import DirectWorkerClient, WorkerDied
from router.fleet.cluster import POOLS, StartupError, WorkerSpawner, root_cause
from router.fleet.worker_ref import WorkerRef  # the serving core imports it from here too
from router.fleet.worker_state import WorkerState
from router.observability import metrics
from router.serving import workers

log = logging.getLogger(__name__)

RESTART_BACKOFF_S = (1.0, 5.0, 15.0)
STARTUPS_KEPT = 5  # recent start-up times per pool (the planner reads their mean)
# Removing a worker's actor and placement group is a GCS round trip of milliseconds; a
# GCS that does not answer in this long is going down with the process group.
GCS_ANSWER_S = 2.0
DRAIN_POLL_S = 0.1
# The states that count towards a pool's target, and that a new worker pairs with.
_COUNTED = (WorkerState.LIVE, WorkerState.STARTING)


class Pools:
    """Owns every worker of a deployment and keeps each pool at its target size."""

    def __init__(self, cluster: WorkerSpawner) -> None:
        self.cluster = cluster
        self.workers: dict[str, list[WorkerRef]] = {pool: [] for pool in POOLS}
        self.targets = dict(cluster.config.initial_sizes)
        self.on_death: list[Callable[[WorkerRef, str], None]] = []
        self.on_removed: list[Callable[[WorkerRef], None]] = []  # dead, drained or stopped
        self.on_live: list[Callable[[WorkerRef], None]] = []  # started, restarted: paired
        # Run as a worker starts draining, before waiting for its requests (live migration).
        self.drain_hooks: list[Callable[[WorkerRef], Awaitable[None]]] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._starting: dict[str, set[int]] = {pool: set() for pool in POOLS}
        self._stopping = False
        self.num_restarts = 0
        # Seconds from asking for a worker to its being live: placement (which may wait
        # for a cluster autoscaler), model load, pairing.
        self.startup_times: dict[str, deque[float]] = {
            p: deque(maxlen=STARTUPS_KEPT) for p in POOLS
        }

    # ---------------------------------------------------------------- views
    def routable(self, pool: str) -> list[WorkerRef]:
        return [w for w in self.workers[pool] if w.alive]

    def all(self) -> list[WorkerRef]:
        return [w for pool in POOLS for w in self.workers[pool]]

    def find(self, worker_id: str) -> WorkerRef | None:
        return next((w for w in self.all() if w.worker_id == worker_id), None)

    def num_starting(self, pool: str) -> int:
        """Workers asked for and not yet live (being placed, loading, pairing)."""
        placed = sum(1 for w in self.workers[pool] if w.state is WorkerState.STARTING)
        return placed + len(self._starting[pool])

    def startup_s(self, pool: str) -> float | None:
        """The mean of the pool's recent start-up times; None before one was measured."""
        times = self.startup_times[pool]
        return sum(times) / len(times) if times else None

    @property
    def reference(self) -> WorkerInfo | None:
        """Any worker's info (model, limits), for the router's checks."""
        refs = self.all()
        return refs[0].info if refs else None

    # ---------------------------------------------------------------- start / stop
    async def start(self) -> None:
        """Start every pool at its initial size; any failure stops them all."""
        self.cluster.start_store()
        spawns = [self._spawn(pool, index) for pool in POOLS for index in range(self.targets[pool])]
        results = await asyncio.gather(*spawns, return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            await self.stop()
            raise failures[0]
        log.info(
            "pools ready: %d prefill + %d decode + %d colocated workers on %s",
            *(len(self.workers[pool]) for pool in POOLS),
            "GPUs" if self.cluster.use_gpus else "CPUs",
        )

    async def stop(self, timeout_s: float = 30.0) -> bool:
        """Shut every worker down (in-flight requests are the caller's to drain first).

        False when Ray itself did not answer within `timeout_s` (its GCS is shutting down
        with the rest of the process group): nothing more can be asked of it then.
        """
        self._stopping = True
        for task in list(self._tasks):
            task.cancel()
        refs = self.all()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(
                asyncio.gather(
                    *(w.handle.shutdown.remote() for w in refs if w.state is not WorkerState.DEAD),
                    return_exceptions=True,
                ),
                timeout_s,
            )
        # Killing actors and removing placement groups are blocking calls to Ray's GCS:
        # off the event loop, and bounded.
        # (A daemon thread, not the loop's executor: asyncio.run waits for that one's
        # threads at exit, and a call to a dead GCS would hold it for a minute.)
        loop = asyncio.get_running_loop()
        removed: asyncio.Future[None] = loop.create_future()

        def remove_all() -> None:
            for ref in refs:
                self._remove(ref)
            loop.call_soon_threadsafe(_resolve, removed)

        threading.Thread(target=remove_all, name="pools-stop", daemon=True).start()
        try:
            await asyncio.wait_for(asyncio.shield(removed), GCS_ANSWER_S)
        except TimeoutError:
            log.warning("Ray did not answer within %.0f s; leaving its teardown", GCS_ANSWER_S)
            return False
        return True

    def _track(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---------------------------------------------------------------- spawning and pairing
    def _free_index(self, pool: str) -> int:
        used = {w.index for w in self.workers[pool]} | self._starting[pool]
        index = 0
        while index in used:
            index += 1
        return index

    async def _spawn(self, pool: str, index: int) -> WorkerRef:
        self._starting[pool].add(index)
        asked = time.monotonic()
        try:
            spawned = await self.cluster.spawn(pool, index)
        finally:
            self._starting[pool].discard(index)
        ref = WorkerRef(
            PoolName(pool), index, spawned.handle, spawned.info, spawned.pg,
            WorkerState.STARTING, client_impl=spawned.client, followers=spawned.followers,
        )  # fmt: skip
        reference = self.reference
        if reference is not None:
            problem = reference.layout.mismatch(ref.info.layout)
            if problem is not None:
                self._remove(ref)
                raise StartupError(
                    f"KV layout mismatch between {reference.worker_id} and {ref.worker_id}: "
                    f"{problem}"
                )
        self.workers[pool].append(ref)
        self._track(self._watch(ref))
        try:
            await self._pair_with_peers(ref)
        except Exception as exc:
            self._remove(ref)
            raise StartupError(f"{ref.worker_id} could not pair: {root_cause(exc)}") from exc
        if ref.state is WorkerState.STARTING:
            ref.state = WorkerState.LIVE
            self.startup_times[pool].append(time.monotonic() - asked)
            log.info(
                "%s live (epoch %s, %s)", ref.worker_id, epoch_hex(ref.info.epoch), ref.info.device
            )
            for callback in self.on_live:
                callback(ref)
        return ref

    def channel_spec(self, sender: workers.WorkerRef, receiver: workers.WorkerRef) -> ChannelSpec:
        """The rendezvous of a channel from `sender` (a prefill worker, or a decode worker
        handing requests over) to `receiver`."""
        return ChannelSpec(
            store_host=self.cluster.store_host,
            store_port=self.cluster.store_port,
            prefill_id=sender.worker_id,
            prefill_epoch=sender.info.epoch,
            decode_id=receiver.worker_id,
            decode_epoch=receiver.info.epoch,
            sender_tp=sender.info.tensor_parallel_size,
            receiver_tp=receiver.info.tensor_parallel_size,
            num_kv_heads=sender.info.layout.num_kv_heads,
        )

    async def link_peers(self, sender: workers.WorkerRef, receiver: workers.WorkerRef) -> None:
        """The KV channel `sender` → `receiver` between two decode workers: both ends
        join its rendezvous at once (router/serving/peer_links.py makes each once)."""
        spec = self.channel_spec(sender, receiver)
        await asyncio.gather(sender.client.connect(spec), receiver.client.connect(spec))

    async def unlink_peers(self, peer: workers.WorkerRef, gone_id: str) -> None:
        """`peer` drops its end of its channels with `gone_id` now (a dead worker's peer
        would otherwise find out only from a broken receive, which NCCL reports after a
        minute)."""
        with contextlib.suppress(WorkerDied):
            await peer.client.disconnect(gone_id, False)

    async def _pair_with_peers(self, ref: WorkerRef) -> None:
        if ref.pool == "colocated":
            return
        other = "decode" if ref.pool == "prefill" else "prefill"
        peers = [w for w in self.workers[other] if w.state in _COUNTED]
        await asyncio.gather(*(self._connect(ref, peer) for peer in peers))

    async def _connect(self, a: WorkerRef, b: WorkerRef) -> None:
        prefill, decode = (a, b) if a.pool == "prefill" else (b, a)
        spec = self.channel_spec(prefill, decode)
        try:
            await asyncio.wait_for(
                asyncio.gather(prefill.client.connect(spec), decode.client.connect(spec)),
                spec.timeout_s,
            )
        except (WorkerDied, TimeoutError) as exc:
            # One side died meanwhile: its watcher cleans up; the pair is simply absent.
            log.warning(
                "pairing %s with %s failed: %s",
                prefill.worker_id,
                decode.worker_id,
                root_cause(exc),
            )
            return
        prefill.peers.add(decode.worker_id)
        decode.peers.add(prefill.worker_id)

    # ---------------------------------------------------------------- death and restart
    async def _watch(self, ref: WorkerRef) -> None:
        try:
            await ref.handle.wait_stopped.remote()
        except RayActorError as exc:
            self.mark_dead(ref, f"{ref.worker_id} died: {_first_line(exc)}")

    def mark_dead(self, ref: workers.WorkerRef, reason: str) -> None:
        """Forget a dead worker, tell the rest, and start its replacement. (`ref` is
        one of these pools' own, handed back by the serving core.)"""
        assert isinstance(ref, WorkerRef)
        if ref.state.ended or self._stopping:
            return
        was_draining = ref.state is WorkerState.DRAINING
        ref.state = WorkerState.DEAD
        log.error("%s", reason)
        for callback in self.on_death:
            callback(ref, reason)
        self._remove(ref)
        for peer in self.all():
            if ref.worker_id in peer.peers:
                peer.peers.discard(ref.worker_id)
                # A survivor never waits on a dead peer: it drops the channel now.
                self._track(self._call_quietly(peer, "disconnect", ref.worker_id, False))
        # Not once Ray is going down with the service: a replacement's first Ray call
        # would block the event loop for the GCS reconnect timeout, then end the process.
        if not was_draining and self.cluster.config.restart_workers and not self.cluster.abandoned:
            metrics.worker_restarted(ref.pool)
            self.num_restarts += 1
            self._track(self._replace(ref.pool, ref.index))

    async def _replace(self, pool: str, index: int) -> None:
        for delay in (0.0, *RESTART_BACKOFF_S):
            await asyncio.sleep(delay)
            if self._stopping or self.cluster.abandoned or self._count(pool) >= self.targets[pool]:
                return
            try:
                await self._spawn(pool, index)
                log.info("%s-%d replaced", pool, index)
                return
            except Exception as exc:  # noqa: BLE001 - retried with backoff, then reported
                log.error("replacing %s-%d failed: %s", pool, index, exc)
        log.error("giving up on replacing %s-%d", pool, index)

    async def _call_quietly(self, ref: WorkerRef, method: str, *args: Any) -> None:
        with contextlib.suppress(WorkerDied, asyncio.CancelledError):
            await getattr(ref.client, method)(*args)

    def _remove(self, ref: WorkerRef) -> None:
        if ref in self.workers[ref.pool]:
            self.workers[ref.pool].remove(ref)
            for callback in self.on_removed:
                callback(ref)
        if ref.state is not WorkerState.DEAD:
            ref.state = WorkerState.GONE
        if isinstance(ref.client_impl, DirectWorkerClient):
            ref.client_impl.close()  # its calls in flight end with WorkerDied
        self.cluster.remove(ref.handle, ref.pg)

    def _count(self, pool: str) -> int:
        """Workers that count towards the target: starting, live (not draining)."""
        live = sum(1 for w in self.workers[pool] if w.state in _COUNTED)
        return live + len(self._starting[pool])

    # ---------------------------------------------------------------- scaling
    async def scale(self, pool: str, size: int) -> None:
        """Grow or shrink a pool to `size` workers; shrinking drains the newest first."""
        if pool not in POOLS:
            raise ValueError(f"unknown pool {pool!r}")
        if size < 0:
            raise ValueError("a pool size must be >= 0")
        self.targets[pool] = size
        current = [w for w in self.workers[pool] if w.state in _COUNTED]
        if size > len(current) + len(self._starting[pool]):
            missing = size - len(current) - len(self._starting[pool])
            indices = []
            for _ in range(missing):
                index = self._free_index(pool)
                self._starting[pool].add(index)
                indices.append(index)
            try:
                await asyncio.gather(*(self._spawn(pool, i) for i in indices))
            except Exception:
                # The target names the workers there are (and those still starting), not
                # one that failed: a later death must not be "replaced" by a new one.
                self.targets[pool] = min(self.targets[pool], self._count(pool))
                raise
        elif size < len(current):
            victims = sorted(current, key=lambda w: w.index)[size:]
            await asyncio.gather(*(self.drain(w.worker_id) for w in victims))

    async def drain(self, worker_id: str, timeout_s: float = 600.0) -> None:
        """No new work for this worker; once its requests finish, it leaves."""
        ref = self.find(worker_id)
        if ref is None:
            raise KeyError(worker_id)
        if ref.state is WorkerState.LIVE:
            ref.state = WorkerState.DRAINING
            if self._count(ref.pool) < self.targets[ref.pool]:
                self.targets[ref.pool] = self._count(ref.pool)
        log.info("%s draining", worker_id)
        for hook in self.drain_hooks:
            await hook(ref)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while ref.state is WorkerState.DRAINING and loop.time() < deadline:
            if ref.num_assigned == 0:
                break
            await asyncio.sleep(DRAIN_POLL_S)
        if ref.state is not WorkerState.DRAINING:
            return  # died meanwhile
        # Peers first, all at once: the prefill end of each channel tells the decode end
        # it is over (closing a channel can take a while: NCCL tears its pair down).
        emptied_at = loop.time()
        peers = [peer for peer in self.all() if worker_id in peer.peers]
        for peer in peers:
            peer.peers.discard(worker_id)
        await asyncio.gather(
            *(self._call_quietly(peer, "disconnect", worker_id, True) for peer in peers)
        )
        disconnected_at = loop.time()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(ref.handle.shutdown.remote(), 30)
        self._remove(ref)
        log.info(
            "%s drained and stopped (%d peer channels closed in %.3f s, stopped in %.3f s)",
            worker_id,
            len(peers),
            disconnected_at - emptied_at,
            loop.time() - disconnected_at,
        )


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
