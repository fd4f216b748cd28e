"""The fleet as the owner sees it, sent to every other router process.

The fleet owner (router process 0) runs the pools: it starts, restarts, scales and
drains the workers. Every other router process routes over a read-only view of them
(router/tier/pools_view.py), kept current by snapshots of `Membership`: each worker's
`WorkerInfo` (its call address among the rest), state and paired peers, the pools'
targets and the prefill policy. The owner takes one every `PUBLISH_EVERY_S` and sends
it when it differs from the last (router/tier/control.py), so a worker joining,
leaving or draining reaches every process well within a second.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.wire import WorkerInfo
from router.routing.prefill_policy import PrefillPolicyConfig

if TYPE_CHECKING:
    from router.serving.workers import Pools

PUBLISH_EVERY_S = 0.1


@dataclass(frozen=True)
class WorkerEntry:
    info: WorkerInfo
    state: str  # starting | live | draining (dead and gone workers are not listed)
    peers: frozenset[str]


@dataclass(frozen=True)
class Membership:
    workers: tuple[WorkerEntry, ...]
    targets: tuple[tuple[str, int], ...]
    prefill_policy: PrefillPolicyConfig | None = None

    def worker_ids(self) -> list[str]:
        return [entry.info.worker_id for entry in self.workers]


def membership_of(pools: Pools, prefill_policy: PrefillPolicyConfig | None) -> Membership:
    """The owner's pools now."""
    return Membership(
        workers=tuple(
            WorkerEntry(ref.info, ref.state, frozenset(ref.peers))
            for ref in pools.all()
            if ref.state in ("starting", "live", "draining")
        ),
        targets=tuple(sorted(pools.targets.items())),
        prefill_policy=prefill_policy,
    )
