"""What the fleet owner and the other router processes say to each other.

The line is a Unix socket in the tier's private folder, authenticated with a key the
owner hands each process it starts (multiprocessing's connection handshake); messages
are pickles, as between the router and its workers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from router.config import ServeConfig


@dataclass(frozen=True)
class Hello:
    """A router process, started by the owner, introduces itself."""

    index: int
    pid: int


@dataclass(frozen=True)
class Bootstrap:
    """What a router process needs to serve: the service's configuration, the port every
    process listens on, how to call the workers, and its share of the tier's state."""

    config: ServeConfig
    num_processes: int
    port: int  # the gRPC port, bound by every process (SO_REUSEPORT)
    call_token: bytes  # the workers' call connections take it
    consumer: str  # this process's name on the workers (a new one each start)
    admission_table: str  # the shared admission table's file
    load_table: str  # the shared table of each process's load on each worker
    admin_address: str  # the owner's AdminService, for this process to forward to


@dataclass(frozen=True)
class Listening:
    """A router process takes calls on the port now."""


@dataclass(frozen=True)
class Drain:
    """The service is stopping: drain (within the grace) and exit."""

    reason: str


@dataclass(frozen=True)
class SignalsReport:
    """A router process's traffic since its last report, for the owner's planner
    (router/tier/signals_relay.py): the `ServingSignals.take` of an interval."""

    taken: tuple[object, ...]


@dataclass(frozen=True)
class LinkPeers:
    """Make the KV channel sender → receiver between two decode workers, each named by
    (worker id, epoch): the owner makes every channel, once per pair of incarnations."""

    seq: int
    sender: tuple[str, int]
    receiver: tuple[str, int]


@dataclass(frozen=True)
class PeersLinked:
    """The answer to `LinkPeers` number `seq`: None, or why the channel is not there."""

    seq: int
    error: str | None


@dataclass(frozen=True)
class Rebalance:
    """MigrateRequests off a decode worker, across the tier: with `budgets_only`, answer
    the token budgets of this process's requests on it (largest first); otherwise move
    the `count` largest of them (None: all) to its peers with their KV. With `drain`, the
    worker drains: every one of them leaves it (by recompute where its KV cannot move),
    and the answer says the moves are over, so the worker and its channels may go."""

    seq: int
    worker_id: str
    epoch: int
    count: int | None
    budgets_only: bool = False
    drain: bool = False


@dataclass(frozen=True)
class Rebalanced:
    """The answer to `Rebalance` number `seq`."""

    seq: int
    budgets: tuple[int, ...] = ()
    num_candidates: int = 0
    with_kv: int = 0
    by_recompute: int = 0
