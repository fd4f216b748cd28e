"""The router's pool supervisor without Ray: a fake cluster whose workers can be killed.

Restart, pairing, scaling and draining are plain asyncio logic; these tests run it in
milliseconds against actors that only record the calls they get.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import pytest
from ray.exceptions import RayActorError

from bench.harness import wait_until_async
from engine.wire import KVLayout, WorkerInfo, epoch_hex
from router.edge.admin import describe
from router.fleet.cluster import Cluster, ClusterConfig, SpawnedWorker
from router.fleet.pools import Pools
from router.fleet.worker_ref import WorkerRef

LAYOUT = KVLayout("m", "float32", 16, 2, 2, 8)
_epochs = itertools.count(1)


class _Method:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        return asyncio.ensure_future(self.fn(*args))


@dataclass
class FakeActor:
    """Records connects and disconnects; dies when told to."""

    worker_id: str
    peers: set[str] = field(default_factory=set)
    dropped: list[str] = field(default_factory=list)  # peers it was told to disconnect
    died: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )

    def __post_init__(self) -> None:
        self.connect = _Method(self._connect)
        self.disconnect = _Method(self._disconnect)
        self.wait_stopped = _Method(self._wait_stopped)
        self.shutdown = _Method(self._shutdown)

    async def _connect(self, spec: Any) -> None:
        self.peers.add(spec.decode_id if self.worker_id.startswith("prefill") else spec.prefill_id)

    async def _disconnect(self, peer: str, notify: bool) -> None:
        self.peers.discard(peer)
        self.dropped.append(peer)

    async def _wait_stopped(self) -> None:
        await self.died

    async def _shutdown(self) -> None:
        if not self.died.done():
            self.died.set_result(None)

    def kill(self) -> None:
        self.died.set_exception(RayActorError())


class FakeCluster:
    def __init__(self, prefill: int = 1, decode: int = 1) -> None:
        self.config = ClusterConfig(num_prefill_workers=prefill, num_decode_workers=decode)
        self.store_host, self.store_port, self.use_gpus = "127.0.0.1", 1, False
        self.abandoned = False
        self.actors: list[FakeActor] = []
        self.removed: list[FakeActor] = []

    def start_store(self) -> None:
        pass

    async def spawn(self, pool: str, index: int) -> SpawnedWorker:
        actor = FakeActor(f"{pool}-{index}")
        self.actors.append(actor)
        info = WorkerInfo(
            f"{pool}-{index}", pool, index, next(_epochs), LAYOUT, 64, 512, 100, "m", "cpu", 1, "x"
        )
        return SpawnedWorker(actor, info, None)

    def remove(self, handle: Any, pg: Any) -> None:
        self.removed.append(handle)


def _live(pools: Pools, pool: str) -> list[WorkerRef]:
    return pools.routable(pool)


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def test_no_worker_is_replaced_once_ray_goes_down_with_the_service() -> None:
    """A worker found dead after the service abandoned Ray (it is going down with the
    process group) is not replaced: starting one would wait on a dead Ray for a minute."""

    async def scenario() -> None:
        cluster = FakeCluster(prefill=1, decode=1)
        pools = Pools(cluster)
        await pools.start()
        spawned = len(cluster.actors)
        cluster.abandoned = True
        victim = _live(pools, "decode")[0]
        victim.handle.kill()
        await _settle()
        await asyncio.sleep(0.2)
        assert victim.state == "dead"
        assert len(cluster.actors) == spawned and pools.num_restarts == 0
        await pools.stop()

    asyncio.run(scenario())


def test_a_dead_worker_is_replaced_with_a_new_epoch_and_paired_again() -> None:
    async def scenario() -> None:
        cluster = FakeCluster(prefill=1, decode=2)
        pools = Pools(cluster)
        deaths: list[str] = []
        pools.on_death.append(lambda ref, reason: deaths.append(ref.worker_id))
        await pools.start()
        prefill = _live(pools, "prefill")[0]
        assert prefill.peers == {"decode-0", "decode-1"}
        victim = _live(pools, "decode")[0]
        old_epoch = victim.info.epoch
        victim.handle.kill()
        await _settle()
        assert deaths == ["decode-0"] and victim.state == "dead"
        assert prefill.handle.dropped == ["decode-0"]  # the survivor dropped its channel

        def replaced() -> bool:
            return any(
                w.worker_id == "decode-0" and w.info.epoch != old_epoch
                for w in _live(pools, "decode")
            )

        await wait_until_async(replaced, 2)
        decode = {w.worker_id: w for w in _live(pools, "decode")}
        assert set(decode) == {"decode-0", "decode-1"}
        assert decode["decode-0"].info.epoch != old_epoch
        assert decode["decode-0"].peers == {"prefill-0"} and "decode-0" in prefill.peers
        assert pools.num_restarts == 1
        await pools.stop()

    asyncio.run(scenario())


def test_scaling_up_pairs_new_workers_and_scaling_down_drains_the_newest() -> None:
    async def scenario() -> None:
        cluster = FakeCluster()
        pools = Pools(cluster)
        await pools.start()
        await pools.scale("prefill", 2)
        await pools.scale("decode", 3)
        assert [w.worker_id for w in _live(pools, "decode")] == ["decode-0", "decode-1", "decode-2"]
        assert all(len(w.peers) == 3 for w in _live(pools, "prefill"))
        busy = _live(pools, "decode")[2]
        busy.num_assigned = 1  # a request still in flight there
        shrink = asyncio.ensure_future(pools.scale("decode", 1))
        await wait_until_async(lambda: busy.state == "draining", 2)
        assert not shrink.done()  # draining, and waiting for the request in flight there
        assert busy not in _live(pools, "decode")  # no new work meanwhile
        busy.num_assigned = 0
        await shrink
        assert [w.worker_id for w in _live(pools, "decode")] == ["decode-0"]
        assert pools.targets["decode"] == 1 and pools.num_restarts == 0
        assert all(w.peers == {"decode-0"} for w in _live(pools, "prefill"))
        await pools.stop()

    asyncio.run(scenario())


def test_a_drained_worker_that_dies_is_not_replaced() -> None:
    async def scenario() -> None:
        cluster = FakeCluster(decode=2)
        pools = Pools(cluster)
        await pools.start()
        ref = _live(pools, "decode")[1]
        ref.num_assigned = 1
        drain = asyncio.ensure_future(pools.drain(ref.worker_id))
        await wait_until_async(lambda: ref.state == "draining", 2)
        ref.handle.kill()
        await drain
        # The death was handled (a restart is decided there and then) and none was counted.
        await wait_until_async(lambda: ref.state == "dead", 2)
        assert [w.worker_id for w in pools.all() if w.pool == "decode"] == ["decode-0"]
        assert pools.num_restarts == 0
        await pools.stop()

    asyncio.run(scenario())


def test_an_epoch_reads_the_same_in_the_log_and_in_pdserve_workers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An epoch with leading zeros keeps them in the log line of a worker going live, as
    in `pdserve workers`: grepping one finds the other."""
    caplog.set_level(logging.INFO, logger="router.fleet.pools")

    async def scenario() -> list[WorkerRef]:
        pools = Pools(FakeCluster(prefill=1, decode=1))
        await pools.start()
        refs = pools.all()
        await pools.stop()
        return refs

    refs = asyncio.run(scenario())
    lines = [r.getMessage() for r in caplog.records]
    for ref in refs:
        shown = describe(ref).epoch
        assert len(shown) == 16 and int(shown, 16) == ref.info.epoch
        assert shown.startswith("0")  # the fake's epochs are small: leading zeros
        assert f"{ref.worker_id} live (epoch {shown}," in " ".join(lines)


def test_an_epoch_is_sixteen_hex_digits_with_its_leading_zeros() -> None:
    assert epoch_hex(0x6CA6) == "0000000000006ca6"
    assert epoch_hex(0x06CA_0000_0000_0001) == "06ca000000000001"
    assert epoch_hex((1 << 62) - 1) == "3fffffffffffffff"


def test_an_abandoned_cluster_makes_no_ray_call_to_remove_a_worker() -> None:
    """Removing a dead worker once Ray goes down with the service: no `ray.kill` nor
    placement group removal, each of which would block for Ray's GCS timeout."""
    cluster = Cluster(ClusterConfig())
    cluster.abandon_ray()
    with (
        mock.patch("router.fleet.cluster.ray.kill") as kill,
        mock.patch("router.fleet.cluster.remove_placement_group") as remove_pg,
    ):
        cluster.remove(object(), mock.Mock())
    assert not kill.called and not remove_pg.called
