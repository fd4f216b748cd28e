"""The router's calls to each kind of worker, written once.

Each protocol below is what the router may call on one kind of worker: the router's
clients (router/fleet/clients.py) carry exactly these, a worker's call connection
(engine/worker/calls.py) answers exactly these, and every worker class is checked
against its kind's protocol by mypy where it is defined, so a verb renamed or retyped on
one side fails at type-check time, not in an end-to-end test. A verb's arguments are
what the router sends; a worker may take more (with defaults) or wider types.
"""

from __future__ import annotations

import inspect
from typing import Protocol

from engine.wire import (
    ChannelSpec,
    DetachedMove,
    DetachedRequest,
    GenerationInput,
    HandoffTarget,
    Handover,
    KVEvents,
    Precopy,
    PrefillResult,
    Reservation,
    TokenBatch,
    WorkerStats,
)


class EveryWorkerCalls(Protocol):
    """What every worker answers."""

    async def abort(self, req_id: str) -> None: ...
    async def load(self) -> WorkerStats: ...


class ChannelCalls(Protocol):
    """A worker with KV channels to peers: join and leave a pair's channel."""

    async def connect(self, spec: ChannelSpec) -> None: ...
    async def disconnect(self, peer_id: str, notify_peer: bool) -> None: ...


class PrefillCalls(EveryWorkerCalls, ChannelCalls, Protocol):
    """A prefill worker: run a prompt and send its KV to a reserved decode worker; its
    prefix-cache changes by long poll, for a router tier's processes."""

    async def prefill(self, inp: GenerationInput, target: HandoffTarget) -> PrefillResult: ...
    async def next_kv_events(self) -> tuple[KVEvents, ...]: ...


class ColocatedCalls(EveryWorkerCalls, Protocol):
    """A colocated worker: run requests whole, tokens out by long poll; a router tier's
    resumed streams find a client's request and take it over from the router process
    that had it (router/serving/run/resume.py)."""

    async def submit(self, inp: GenerationInput) -> None: ...
    async def next_tokens(self) -> TokenBatch: ...
    async def locate(self, request_id: str) -> str | None: ...
    async def adopt(self, req_id: str) -> Handover | None: ...
    async def let_go(self, req_id: str) -> bool: ...


class DecodeCalls(ColocatedCalls, ChannelCalls, Protocol):
    """A decode worker: a colocated worker's calls, blocks reserved for incoming KV, and a
    running request moved to a peer (live migration, decode_worker/export.py)."""

    async def reserve(
        self, inp: GenerationInput, lease_s: float, source: str | None
    ) -> Reservation | None: ...
    async def reserve_many(
        self, inps: list[GenerationInput], lease_s: float, source: str | None
    ) -> list[Reservation | None]: ...
    async def renew(self, req_ids: list[str], lease_s: float) -> int: ...
    async def precopy(self, target: HandoffTarget, moves: list[Precopy]) -> dict[str, int]: ...
    async def detach(self, req_ids: list[str]) -> list[DetachedRequest | None]: ...
    async def send_detached(self, target: HandoffTarget, moves: list[DetachedMove]) -> int: ...


class WorkerCalls(PrefillCalls, DecodeCalls, Protocol):
    """Every kind's calls: what the router's client for a worker of any pool carries
    (each pool's workers answer their own kind's)."""


def verbs(calls: type) -> frozenset[str]:
    """The verbs of a calls protocol: its public coroutine methods, inherited ones too."""
    return frozenset(
        name
        for name, member in inspect.getmembers(calls, inspect.iscoroutinefunction)
        if not name.startswith("_")
    )


PREFILL_VERBS = verbs(PrefillCalls)
DECODE_VERBS = verbs(DecodeCalls)
COLOCATED_VERBS = verbs(ColocatedCalls)
WORKER_VERBS = verbs(WorkerCalls)
