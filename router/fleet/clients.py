"""Typed clients for the workers: the router's only way to call them.

Each carries the calls to one worker, over the worker's own call connection
(`DirectWorkerClient`, the default; engine/worker/calls.py) or as Ray actor calls
(`RayWorkerClient`), and turns a lost worker into `WorkerDied`, so the serving
core speaks in the workers' own verbs and types and a renamed worker method fails at
type-check time, not in an end-to-end test. Tests give the serving core fakes with the
same methods (bench/fake_workers.py) and exercise retries, the local path, stop strings
and aborts in milliseconds.
"""

from __future__ import annotations

from typing import Any, Protocol, cast

from ray.exceptions import RayActorError

from engine.wire import (
    ChannelSpec,
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
from engine.worker.calls import CallClient, CallsLost


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


class _VerbClient:
    """Both roles' verbs, each one `_invoke(verb, *args)` (a colocated worker is a decode
    worker); subclasses carry the calls."""

    async def _invoke(self, verb: str, *args: Any) -> Any:
        raise NotImplementedError

    async def prefill(self, inp: GenerationInput, target: HandoffTarget) -> PrefillResult:
        return cast(PrefillResult, await self._invoke("prefill", inp, target))

    async def reserve(
        self, inp: GenerationInput, lease_s: float, source: str | None
    ) -> Reservation | None:
        return cast("Reservation | None", await self._invoke("reserve", inp, lease_s, source))

    async def reserve_many(
        self, inps: list[GenerationInput], lease_s: float, source: str | None
    ) -> list[Reservation | None]:
        return cast(
            "list[Reservation | None]", await self._invoke("reserve_many", inps, lease_s, source)
        )

    async def renew(self, req_ids: list[str], lease_s: float) -> int:
        return cast(int, await self._invoke("renew", req_ids, lease_s))

    async def submit(self, inp: GenerationInput) -> None:
        await self._invoke("submit", inp)

    async def next_tokens(self) -> TokenBatch:
        return cast(TokenBatch, await self._invoke("next_tokens"))

    async def abort(self, req_id: str) -> None:
        await self._invoke("abort", req_id)

    async def load(self) -> WorkerStats:
        return cast(WorkerStats, await self._invoke("load"))

    async def connect(self, spec: ChannelSpec) -> None:
        await self._invoke("connect", spec)

    async def disconnect(self, peer_id: str, notify_peer: bool) -> None:
        await self._invoke("disconnect", peer_id, notify_peer)

    async def precopy(self, target: HandoffTarget, moves: list[Precopy]) -> dict[str, int]:
        return cast("dict[str, int]", await self._invoke("precopy", target, moves))

    async def detach(self, req_ids: list[str]) -> list[DetachedRequest | None]:
        return cast("list[DetachedRequest | None]", await self._invoke("detach", req_ids))

    async def send_detached(self, target: HandoffTarget, moves: list[DetachedMove]) -> int:
        return cast(int, await self._invoke("send_detached", target, moves))


class RayWorkerClient(_VerbClient):
    """Every verb as a Ray actor call on `handle`."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    async def _invoke(self, verb: str, *args: Any) -> Any:
        try:
            return await getattr(self.handle, verb).remote(*args)
        except RayActorError as exc:
            raise WorkerDied(str(exc)) from exc


class DirectWorkerClient(_VerbClient):
    """Every verb over the worker's own call connection (engine/worker/calls.py); Ray still
    starts, watches and stops the worker."""

    def __init__(self, address: str, token: bytes) -> None:
        self.calls = CallClient(address, token)

    async def _invoke(self, verb: str, *args: Any) -> Any:
        try:
            return await self.calls.call(verb, *args)
        except CallsLost as exc:
            raise WorkerDied(str(exc)) from exc

    def close(self) -> None:
        self.calls.close()
