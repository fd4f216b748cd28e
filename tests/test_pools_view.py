"""A router process's view of the owner's fleet, from membership snapshots: workers
appear, go live, drain and leave as the owner says, each with this process's own
client; one found dead here stays dead until the owner lists its replacement."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from bench.fake_workers import FakePools
from router.fleet.clients import DirectWorkerClient
from router.fleet.pools import WorkerRef
from router.fleet.worker_state import WorkerState
from router.tier.membership import Membership, WorkerEntry, membership_of
from router.tier.pools_view import PoolsView


def snapshot(*entries: tuple[Any, str]) -> Membership:
    # A real worker's info names its call address; the view's client connects lazily.
    return Membership(
        tuple(
            WorkerEntry(replace(info, call_address="127.0.0.1:9"), state, frozenset())
            for info, state in entries
        ),
        (("colocated", 0), ("decode", 1), ("prefill", 1)),
    )


def test_the_view_follows_the_owners_snapshots() -> None:
    fleet = FakePools(1, 1)
    prefill, decode = (ref.info for ref in fleet.all())
    view = PoolsView(b"t" * 32, "router-1-abc", 30.0)
    live: list[str] = []
    died: list[str] = []
    removed: list[str] = []
    view.on_live.append(lambda ref: live.append(ref.worker_id))
    view.on_death.append(lambda ref, why: died.append(ref.worker_id))
    view.on_removed.append(lambda ref: removed.append(ref.worker_id))

    view.apply(snapshot((prefill, "live"), (decode, "starting")))
    assert live == ["prefill-0"]
    assert [r.worker_id for r in view.routable("prefill")] == ["prefill-0"]
    assert view.routable("decode") == []
    ref = view.find("decode-0")
    assert ref is not None
    client = ref.client
    assert isinstance(client, DirectWorkerClient) and client.consumer == "router-1-abc"

    view.apply(snapshot((prefill, "live"), (decode, "live")))
    assert live == ["prefill-0", "decode-0"]
    view.apply(snapshot((prefill, "live"), (decode, "draining")))
    assert view.routable("decode") == [] and ref.state == "draining"
    view.apply(snapshot((prefill, "live")))  # it left
    assert died == ["decode-0"] and removed == ["decode-0"]
    assert view.find("decode-0") is None


def test_a_worker_found_dead_here_stays_dead_until_replaced() -> None:
    fleet = FakePools(1, 1)
    prefill, decode = (ref.info for ref in fleet.all())
    view = PoolsView(b"t" * 32, "router-1-abc", 30.0)
    view.apply(snapshot((prefill, "live"), (decode, "live")))
    ref = view.find("decode-0")
    assert isinstance(ref, WorkerRef)
    view.mark_dead(ref, "decode-0 died")
    view.apply(snapshot((prefill, "live"), (decode, "live")))  # the owner has not noticed
    assert view.find("decode-0") is None
    replacement = fleet.replace("decode-0").info  # same id, new epoch
    view.apply(snapshot((prefill, "live"), (replacement, "live")))
    found = view.find("decode-0")
    assert found is not None and found.info.epoch == replacement.epoch


def test_the_owners_membership_lists_live_starting_and_draining_workers() -> None:
    fleet = FakePools(1, 2)
    fleet.workers["decode"][1].state = WorkerState.DRAINING
    m = membership_of(fleet, None)
    assert sorted((e.info.worker_id, e.state) for e in m.workers) == [
        ("decode-0", "live"),
        ("decode-1", "draining"),
        ("prefill-0", "live"),
    ]
    assert dict(m.targets)["decode"] == 2
