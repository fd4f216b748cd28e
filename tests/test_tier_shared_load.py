"""A router tier's shared load: each process routes by what every process has on a
worker, not by its own requests alone."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from engine.wire import KVLayout, PoolName, WorkerInfo
from router.fleet.worker_ref import WorkerRef
from router.routing.cache_aware import RoutingConfig
from router.routing.kv_index import PrefixIndex
from router.routing.placement import route_by_cache, route_by_work
from router.tier.shared_load import SLOTS_PER_POOL, LoadSharing, LoadTable

LAYOUT = KVLayout("m", "float32", 16, 2, 2, 8)


def _ref(pool: str, index: int, epoch: int) -> WorkerRef:
    info = WorkerInfo(
        f"{pool}-{index}", pool, index, epoch, LAYOUT, 64, 512, 100, "m", "cpu", 1, "x"
    )
    return WorkerRef(PoolName(pool), index, None, info)


class _Pools:
    """Each process's own refs to the same workers, as `Pools` or a `PoolsView` has."""

    def __init__(self, refs: list[WorkerRef]) -> None:
        self.refs = refs
        self.on_live: list[Callable[[WorkerRef], None]] = []
        self.on_removed: list[Callable[[WorkerRef], None]] = []

    def all(self) -> list[WorkerRef]:
        return list(self.refs)


def _two_processes(tmp_path: Path, pool: str = "prefill") -> tuple[list[WorkerRef], ...]:
    table = LoadTable(str(tmp_path / "load"), 2, create=True)
    views = []
    for row in range(2):
        refs = [_ref(pool, 0, 11), _ref(pool, 1, 12)]
        LoadSharing(LoadTable(table.path, 2), row).follow(_Pools(refs))
        views.append(refs)
    return tuple(views)


def test_each_process_sees_the_others_requests_and_queued_tokens(tmp_path: Path) -> None:
    mine, theirs = _two_processes(tmp_path)
    lease = theirs[0].load.lease(num_tokens=300)
    assert (mine[0].load.service_assigned, mine[0].load.service_queued_tokens) == (1, 300)
    assert mine[0].num_assigned == 0  # its own count is its own
    assert (mine[1].load.service_assigned, mine[1].load.service_queued_tokens) == (0, 0)
    lease.done_with_tokens()
    assert (mine[0].load.service_assigned, mine[0].load.service_queued_tokens) == (1, 0)
    lease.release()
    assert mine[0].load.service_assigned == 0


def test_a_prompt_goes_to_the_worker_the_other_processes_are_not_loading(
    tmp_path: Path,
) -> None:
    mine, theirs = _two_processes(tmp_path)
    leases = [theirs[0].load.lease(num_tokens=400) for _ in range(3)]
    index = PrefixIndex(16)
    config = RoutingConfig()
    chosen = route_by_work(index, [], 64, config)(mine)
    assert chosen is mine[1]
    for lease in leases:
        lease.release()
    assert route_by_work(index, [], 64, config)(mine) is mine[0]  # the tie goes to 0


def test_decode_routing_weighs_every_processs_requests(tmp_path: Path) -> None:
    mine, theirs = _two_processes(tmp_path, pool="decode")
    leases = [theirs[0].load.lease() for _ in range(8)]
    assert route_by_cache(PrefixIndex(16), [], RoutingConfig())(mine) is mine[1]
    for lease in leases:
        lease.release()


def test_a_replacement_does_not_inherit_its_predecessors_counts(tmp_path: Path) -> None:
    table = LoadTable(str(tmp_path / "load"), 2, create=True)
    old_here, old_there = _ref("decode", 0, 5), _ref("decode", 0, 5)
    pools_here, pools_there = _Pools([old_here]), _Pools([old_there])
    LoadSharing(table, 0).follow(pools_here)
    there = LoadSharing(table, 1)
    there.follow(pools_there)
    stuck = old_there.load.lease()
    new_here, new_there = _ref("decode", 0, 6), _ref("decode", 0, 6)
    for hook in pools_here.on_live:
        hook(new_here)
    for hook in pools_there.on_removed:
        hook(old_there)
    for hook in pools_there.on_live:
        hook(new_there)
    assert new_here.load.service_assigned == 0  # the old epoch's request is not its
    stuck.release()  # the old incarnation's request ends late: the new cells stand
    new_lease = new_there.load.lease()
    assert new_here.load.service_assigned == 1
    new_lease.release()


def test_a_process_that_restarts_holds_nothing(tmp_path: Path) -> None:
    mine, theirs = _two_processes(tmp_path)
    theirs[0].load.lease(num_tokens=50)
    assert mine[0].load.service_assigned == 1
    LoadTable(str(tmp_path / "load"), 2).clear(1)  # the owner, as process 1 dies
    assert mine[0].load.service_assigned == 0


def test_a_worker_past_the_tables_slots_is_counted_alone(tmp_path: Path) -> None:
    table = LoadTable(str(tmp_path / "load"), 2, create=True)
    assert table.share(0, "decode", SLOTS_PER_POOL, 1) is None
    ref = _ref("decode", SLOTS_PER_POOL, 1)
    LoadSharing(table, 0).follow(_Pools([ref]))
    ref.load.lease().release()
    assert ref.load.share is None and ref.load.service_assigned == 0
