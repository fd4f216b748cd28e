"""The router's view of one worker incarnation: where it is, its state, its peers, its
load, and the typed client for its verbs (router.fleet.clients)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.wire import PoolName, WorkerInfo
from router.fleet.clients import RayWorkerClient, WorkerClient
from router.fleet.worker_state import WorkerState
from router.routing.cache_aware import WorkerLoadView
from router.routing.worker_load import WorkerLoad


@dataclass(eq=False)
class WorkerRef:
    """The router's view of one worker incarnation."""

    pool: PoolName
    index: int
    handle: Any
    info: WorkerInfo
    pg: Any = None
    state: WorkerState = WorkerState.LIVE
    peers: set[str] = field(default_factory=set)  # worker ids with a connected channel
    load: WorkerLoad = field(default_factory=WorkerLoad)
    # The worker's verbs (tests give a fake; None: the Ray actor behind `handle`).
    client_impl: WorkerClient | None = None
    # A tensor-parallel worker's other ranks: kept alive by this reference, ended with
    # the placement group when the worker is removed.
    followers: tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        self.load.assume(self.info.speed)

    @property
    def client(self) -> WorkerClient:
        """The typed client for this worker's verbs."""
        if self.client_impl is None:
            self.client_impl = RayWorkerClient(self.handle)
        return self.client_impl

    @property
    def num_assigned(self) -> int:
        """Requests this router has in flight on it."""
        return self.load.num_assigned

    @num_assigned.setter
    def num_assigned(self, value: int) -> None:
        self.load.num_assigned = value

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    @property
    def alive(self) -> bool:
        """Routable: live and not draining."""
        return self.state is WorkerState.LIVE

    def view(self) -> WorkerLoadView:
        stats = self.load.stats
        free = stats.num_blocks_free if stats is not None else 0
        return WorkerLoadView(self.index, self.alive, self.load.service_assigned, free)
