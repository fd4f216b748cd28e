"""The pools and their workers as the serving core sees them: only what it uses.

`router.fleet.pools` implements these over Ray actors; `bench/fake_workers.py` fakes
them in process, for the core's tests and `bench.router_load`. The core never names
either: it is handed a `Pools` and reads `WorkerRef`s off it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence, Set
from typing import TYPE_CHECKING, Protocol, TypeVar

from engine.wire import PoolName
from router.fleet.worker_state import WorkerState

if TYPE_CHECKING:  # torch behind the first two: none of it is needed at run time here
    from engine.worker.actor import WorkerInfo
    from router.fleet.clients import WorkerClient
    from router.routing.cache_aware import WorkerLoadView
    from router.routing.worker_load import WorkerLoad

Hook = TypeVar("Hook", contravariant=True)


class Hooks(Protocol[Hook]):
    """A list of callbacks the pools call; the core only adds to it."""

    def append(self, hook: Hook, /) -> None: ...


class WorkerRef(Protocol):
    """One worker incarnation: who it is, its state, its load account and its calls."""

    @property
    def pool(self) -> PoolName: ...
    @property
    def index(self) -> int: ...
    @property
    def worker_id(self) -> str: ...
    @property
    def state(self) -> WorkerState: ...
    @property
    def info(self) -> WorkerInfo: ...
    @property
    def peers(self) -> Set[str]:
        """Worker ids it has a KV channel with."""
        ...

    @property
    def load(self) -> WorkerLoad: ...
    @property
    def client(self) -> WorkerClient: ...
    @property
    def num_assigned(self) -> int: ...
    def view(self) -> WorkerLoadView: ...


class Pools(Protocol):
    """The live pools: which workers there are, their deaths and arrivals."""

    @property
    def targets(self) -> Mapping[str, int]:
        """Each pool's target size (a pool of 0 is not deployed)."""
        ...

    @property
    def reference(self) -> WorkerInfo | None:
        """Any worker's info (model, limits)."""
        ...

    def all(self) -> Sequence[WorkerRef]: ...
    def routable(self, pool: PoolName) -> Sequence[WorkerRef]: ...
    def mark_dead(self, ref: WorkerRef, reason: str) -> None:
        """A call found it dead: forget it, tell the hooks, replace it."""
        ...

    async def link_peers(self, sender: WorkerRef, receiver: WorkerRef) -> None:
        """Make the KV channel `sender` → `receiver` between two decode workers (live
        migration); the fleet's owner makes every channel, once per pair of incarnations."""
        ...

    async def unlink_peers(self, peer: WorkerRef, gone_id: str) -> None:
        """`peer` drops its channels with `gone_id`, which left (a no-op where another
        process owns the fleet: it does so itself)."""
        ...

    @property
    def on_death(self) -> Hooks[Callable[[WorkerRef, str], None]]: ...
    @property
    def on_removed(self) -> Hooks[Callable[[WorkerRef], None]]:
        """Dead, drained or stopped."""
        ...

    @property
    def on_live(self) -> Hooks[Callable[[WorkerRef], None]]:
        """Started or restarted, and paired."""
        ...

    @property
    def drain_hooks(self) -> Hooks[Callable[[WorkerRef], Awaitable[None]]]:
        """Run as a worker starts draining, before waiting for its requests."""
        ...
