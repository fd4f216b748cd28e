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

from dataclasses import replace
from typing import Any, Protocol, cast

from ray.exceptions import RayActorError

from engine.transfer.channel import ChannelSpec
from engine.wire import (
    DetachedMove,
    DetachedRequest,
    GenerationInput,
    HandoffTarget,
    Handover,
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
    # A router tier's resumed streams (router/tier/resume.py): find a client's request,
    # take it over from the router process that had it.
    async def locate(self, request_id: str) -> str | None: ...
    async def adopt(self, req_id: str) -> Handover | None: ...
    async def let_go(self, req_id: str) -> bool: ...
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
    worker); subclasses carry the calls.

    `consumer`: this router process's name in a router tier ("" without one). Every
    request it sends carries it, and it polls and aborts as it: a decode worker sends
    each request's updates to the process that owns it (decode_worker/outboxes.py).
    `grace_s`: how long the worker keeps this process's requests for another to take
    over, should this one go away."""

    consumer = ""
    grace_s = 0.0

    async def _invoke(self, verb: str, *args: Any) -> Any:
        raise NotImplementedError

    def _owned(self, inp: GenerationInput) -> GenerationInput:
        if self.consumer and inp.consumer != self.consumer:
            return replace(inp, consumer=self.consumer)
        return inp

    async def prefill(self, inp: GenerationInput, target: HandoffTarget) -> PrefillResult:
        return cast(PrefillResult, await self._invoke("prefill", self._owned(inp), target))

    async def reserve(
        self, inp: GenerationInput, lease_s: float, source: str | None
    ) -> Reservation | None:
        return cast(
            "Reservation | None",
            await self._invoke("reserve", self._owned(inp), lease_s, source),
        )

    async def reserve_many(
        self, inps: list[GenerationInput], lease_s: float, source: str | None
    ) -> list[Reservation | None]:
        owned = [self._owned(inp) for inp in inps]
        return cast(
            "list[Reservation | None]", await self._invoke("reserve_many", owned, lease_s, source)
        )

    async def renew(self, req_ids: list[str], lease_s: float) -> int:
        return cast(int, await self._invoke("renew", req_ids, lease_s))

    async def submit(self, inp: GenerationInput) -> None:
        await self._invoke("submit", self._owned(inp))

    async def next_tokens(self) -> TokenBatch:
        if not self.consumer:
            return cast(TokenBatch, await self._invoke("next_tokens"))
        return cast(TokenBatch, await self._invoke("next_tokens", 1.0, self.consumer, self.grace_s))

    async def abort(self, req_id: str) -> None:
        if not self.consumer:
            await self._invoke("abort", req_id)
        else:
            await self._invoke("abort", req_id, self.consumer)

    async def locate(self, request_id: str) -> str | None:
        return cast("str | None", await self._invoke("locate", request_id))

    async def adopt(self, req_id: str) -> Handover | None:
        return cast("Handover | None", await self._invoke("adopt", req_id, self.consumer))

    async def let_go(self, req_id: str) -> bool:
        """Keep the request for `grace_s` for a resumed stream (False: not kept)."""
        if not self.consumer:
            return False
        return cast(bool, await self._invoke("let_go", req_id, self.consumer, self.grace_s))

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
