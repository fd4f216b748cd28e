"""Typed clients for the workers: the router's only way to call them.

Each carries the calls to one worker, over the worker's own call connection
(`DirectWorkerClient`, the default; engine/worker/calls.py) or as Ray actor calls
(`RayWorkerClient`), and turns a lost worker into `WorkerDied`. Both carry exactly the
verbs of the workers' contract (engine/worker/contract.py, `WorkerCalls`), each one
`_invoke(verb, *args)`: the serving core speaks in the workers' own verbs and types, and
a renamed worker method fails at type-check time, not in an end-to-end test. Tests give
the serving core fakes with the same methods (bench/fake_workers.py) and exercise
retries, the local path, stop strings and aborts in milliseconds.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine
from dataclasses import replace
from typing import Any, cast

from ray.exceptions import RayActorError

from engine.wire import (
    GenerationInput,
    HandoffTarget,
    Handover,
    KVEvents,
    PrefillResult,
    Reservation,
    TokenBatch,
)
from engine.worker.calls import CallClient, CallsLost
from engine.worker.contract import WORKER_VERBS, WorkerCalls

# What the router may call on a worker of any pool: the contract's every verb.
WorkerClient = WorkerCalls
# How long a poll of a prefill worker's prefix-cache changes waits for some.
KV_POLL_S = 1.0


class WorkerDied(RuntimeError):
    """The worker's process is gone (the call may or may not have run)."""


class _VerbClient:
    """Every verb of the contract, each one `_invoke(verb, *args)`, made on first use;
    subclasses carry the calls. Typed as the contract's `WorkerCalls` (mypy reads the
    verbs through `__getattr__`), the one place the verbs are declared.

    `consumer`: this router process's name in a router tier ("" without one). Every
    request it sends carries it, and it polls and aborts as it: a decode worker sends
    each request's updates to the process that owns it (decode_worker/outboxes.py); the
    verbs that carry it are written out below, the others made from the contract.
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
        owned = self._owned(inp)
        return cast("Reservation | None", await self._invoke("reserve", owned, lease_s, source))

    async def reserve_many(
        self, inps: list[GenerationInput], lease_s: float, source: str | None
    ) -> list[Reservation | None]:
        owned = [self._owned(inp) for inp in inps]
        return cast(
            "list[Reservation | None]", await self._invoke("reserve_many", owned, lease_s, source)
        )

    async def submit(self, inp: GenerationInput) -> None:
        await self._invoke("submit", self._owned(inp))

    async def next_tokens(self) -> TokenBatch:
        if not self.consumer:
            return cast(TokenBatch, await self._invoke("next_tokens"))
        return cast(TokenBatch, await self._invoke("next_tokens", 1.0, self.consumer, self.grace_s))

    async def next_kv_events(self) -> tuple[KVEvents, ...]:
        events = await self._invoke("next_kv_events", KV_POLL_S, self.consumer)
        return cast("tuple[KVEvents, ...]", events)

    async def abort(self, req_id: str) -> None:
        if not self.consumer:
            await self._invoke("abort", req_id)
        else:
            await self._invoke("abort", req_id, self.consumer)

    async def adopt(self, req_id: str) -> Handover | None:
        return cast("Handover | None", await self._invoke("adopt", req_id, self.consumer))

    async def let_go(self, req_id: str) -> bool:
        """Keep the request for `grace_s` for a resumed stream (False: not kept)."""
        if not self.consumer:
            return False
        return cast(bool, await self._invoke("let_go", req_id, self.consumer, self.grace_s))

    def __getattr__(self, verb: str) -> Callable[..., Coroutine[Any, Any, Any]]:
        if verb not in WORKER_VERBS:
            raise AttributeError(f"{type(self).__name__} has no verb {verb!r}")
        call = functools.partial(self._invoke, verb)
        setattr(self, verb, call)  # found without __getattr__ from now on
        return call


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
