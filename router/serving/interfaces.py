"""The interfaces the serving core's parts are handed one another by (router/serving/
orchestrator.py makes the parts and wires them): each part names what it uses as one of
these Protocols, never the class that implements it, so a test can hand it a fake.

The pools and their workers are seen through router/serving/workers.py; a request's
events go out through router/serving/events.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:
    from engine.core.kv_events import KVEvents
    from engine.core.outputs import TextChunk
    from engine.core.request import FinishReason
    from engine.wire import GenerationInput, PoolName
    from router.fleet.clients import WorkerDied
    from router.routing.prefill_policy import PathDecision
    from router.routing.worker_load import WorkerLease
    from router.serving.run.attempts import Attempt, ClientRequest
    from router.serving.workers import WorkerRef

T = TypeVar("T")


@dataclass(frozen=True)
class Started:
    """How an attempt's stream begins, as its path leaves it: the tokens the path already
    has (a prefill's first token) and their finish, and the lease of a prompt run on its
    decode worker (the stream reads the prompt's compute time off the first token's
    update)."""

    tokens: tuple[int, ...] = ()
    finish_reason: FinishReason | None = None
    local: WorkerLease | None = None


class Placement(Protocol):
    """Which workers an attempt goes to, and where its prompt runs (`WorkerChoice`)."""

    @property
    def routing_policy(self) -> str: ...
    def hash_prompt(self, pool: PoolName, token_ids: Sequence[int]) -> list[int]: ...
    def num_cached(self, ref: WorkerRef, hashes: list[int]) -> int: ...
    async def token_worker(self, pool: PoolName, hashes: list[int]) -> WorkerRef: ...
    def prompt_path(
        self, inp: GenerationInput, hashes: list[int], decode_ref: WorkerRef, run_locally: bool
    ) -> tuple[PathDecision, WorkerRef | None, int]: ...


class Aborts(Protocol):
    def abort(self, ref: WorkerRef, req_id: str) -> None:
        """Abort `req_id` on `ref`, in the background."""
        ...


class Calls(Aborts, Protocol):
    """Worker calls on a request's behalf (`WorkerCalls`)."""

    async def call(self, ref: WorkerRef, pending: Awaitable[T]) -> T: ...
    def died(self, ref: WorkerRef, exc: WorkerDied) -> str: ...


class KVEventSink(Protocol):
    """Where a worker's prefix-cache changes go (`TokenDelivery`)."""

    def apply_kv_events(self, ref: WorkerRef, batches: tuple[KVEvents, ...]) -> None: ...


class Followers(Protocol):
    """Who follows the token-producing workers (`TokenDelivery`)."""

    def ensure_pollers(self) -> None: ...


class Renewals(Protocol):
    """Reservations renewed while their requests wait (`LeaseRenewer`)."""

    def hold(self, ref: WorkerRef, req_id: str) -> None: ...
    def release(self, ref: WorkerRef, req_id: str) -> None: ...


class Slots(Protocol):
    """Admission (`Admission`)."""

    def slot(self, priority: int = 0) -> AbstractAsyncContextManager[None]: ...


class AttemptBook(Protocol):
    """The attempts in flight (`InFlight`)."""

    def begin(self, request: ClientRequest, number: int) -> Attempt: ...
    def end(self, attempt: Attempt, abort: bool = True) -> None: ...


class Path(Protocol):
    """How an attempt starts (`ColocatedPath`, `DisaggregatedPath`)."""

    async def start(
        self, request: ClientRequest, attempt: Attempt, run_locally: bool
    ) -> Started: ...


class Streamer(Protocol):
    """How an attempt streams (`ChunkStream`)."""

    def stream(
        self, request: ClientRequest, attempt: Attempt, start: Started
    ) -> AsyncIterator[TextChunk]: ...
