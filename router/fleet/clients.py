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
from typing import Any

from ray.exceptions import RayActorError

from engine.worker.calls import CallClient, CallsLost
from engine.worker.contract import WORKER_VERBS, WorkerCalls

# What the router may call on a worker of any pool: the contract's every verb.
WorkerClient = WorkerCalls


class WorkerDied(RuntimeError):
    """The worker's process is gone (the call may or may not have run)."""


class _VerbClient:
    """Every verb of the contract, each one `_invoke(verb, *args)`, made on first use;
    subclasses carry the calls. Typed as the contract's `WorkerCalls` (mypy reads the
    verbs through `__getattr__`), the one place the verbs are declared."""

    async def _invoke(self, verb: str, *args: Any) -> Any:
        raise NotImplementedError

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
