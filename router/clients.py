"""Typed clients for the workers: the router's only way to call them.

Each wraps a Ray actor handle and turns Ray's failure into `WorkerDied`, so the serving
core speaks in the workers' own verbs and types and a renamed worker method fails at
type-check time, not in an end-to-end test. Tests give the serving core fakes with the
same methods (bench/fake_workers.py) and exercise retries, the local path, stop strings
and aborts in milliseconds.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, Protocol, TypeVar

from ray.exceptions import RayActorError

from engine.transfer.channel import ChannelSpec
from engine.wire import (
    DetachedMove,
    DetachedRequest,
    GenerationInput,
    HandoffTarget,
    Precopy,
    PrefillResult,
    Reservation,
    TokenBatch,
    WorkerStats,
)

T = TypeVar("T")


class WorkerDied(RuntimeError):
    """The worker's process is gone (the call may or may not have run)."""


class PrefillClient(Protocol):
    async def prefill(self, inp: GenerationInput, target: HandoffTarget) -> PrefillResult: ...
    async def abort(self, req_id: str) -> None: ...
    async def load(self) -> WorkerStats: ...


class DecodeClient(Protocol):
    async def reserve(
        self, inp: GenerationInput, lease_s: float, source: str | None
    ) -> Reservation | None: ...
    async def reserve_many(
        self, inps: list[GenerationInput], lease_s: float, source: str | None
    ) -> list[Reservation | None]: ...
    async def renew(self, req_ids: list[str], lease_s: float) -> int: ...
    async def submit(self, inp: GenerationInput) -> None: ...
    async def next_tokens(self) -> TokenBatch: ...
    async def abort(self, req_id: str) -> None: ...
    async def load(self) -> WorkerStats: ...
    # Live migration (decode_worker/export.py): a channel to a peer, and moving a request.
    async def connect(self, spec: ChannelSpec) -> None: ...
    async def disconnect(self, peer_id: str, notify_peer: bool) -> None: ...
    async def precopy(self, target: HandoffTarget, moves: list[Precopy]) -> dict[str, int]: ...
    async def detach(self, req_ids: list[str]) -> list[DetachedRequest | None]: ...
    async def send_detached(self, target: HandoffTarget, moves: list[DetachedMove]) -> int: ...


class WorkerClient(PrefillClient, DecodeClient, Protocol):
    """Every verb of a worker; each pool's workers answer their own role's."""


async def _call(pending: Awaitable[T]) -> T:
    try:
        return await pending
    except RayActorError as exc:
        raise WorkerDied(str(exc)) from exc


class RayWorkerClient:
    """Both roles' verbs over one actor handle (a colocated worker is a decode worker)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    async def prefill(self, inp: GenerationInput, target: HandoffTarget) -> PrefillResult:
        return await _call(self.handle.prefill.remote(inp, target))

    async def reserve(
        self, inp: GenerationInput, lease_s: float, source: str | None
    ) -> Reservation | None:
        return await _call(self.handle.reserve.remote(inp, lease_s, source))

    async def reserve_many(
        self, inps: list[GenerationInput], lease_s: float, source: str | None
    ) -> list[Reservation | None]:
        return await _call(self.handle.reserve_many.remote(inps, lease_s, source))

    async def renew(self, req_ids: list[str], lease_s: float) -> int:
        return await _call(self.handle.renew.remote(req_ids, lease_s))

    async def submit(self, inp: GenerationInput) -> None:
        await _call(self.handle.submit.remote(inp))

    async def next_tokens(self) -> TokenBatch:
        return await _call(self.handle.next_tokens.remote())

    async def abort(self, req_id: str) -> None:
        await _call(self.handle.abort.remote(req_id))

    async def load(self) -> WorkerStats:
        return await _call(self.handle.load.remote())

    async def connect(self, spec: ChannelSpec) -> None:
        await _call(self.handle.connect.remote(spec))

    async def disconnect(self, peer_id: str, notify_peer: bool) -> None:
        await _call(self.handle.disconnect.remote(peer_id, notify_peer))

    async def precopy(self, target: HandoffTarget, moves: list[Precopy]) -> dict[str, int]:
        return await _call(self.handle.precopy.remote(target, moves))

    async def detach(self, req_ids: list[str]) -> list[DetachedRequest | None]:
        return await _call(self.handle.detach.remote(req_ids))

    async def send_detached(self, target: HandoffTarget, moves: list[DetachedMove]) -> int:
        return await _call(self.handle.send_detached.remote(target, moves))
