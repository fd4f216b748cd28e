"""Deadline-bounded waits: poll a condition until it holds or the deadline passes.

A test that sleeps a fixed time and then asserts "not done yet" proves nothing on a slow
machine (the thing may not have started) and flakes on a fast one; wait for the event
that shows the state was reached instead, with a deadline that only bounds a failure.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar, overload

T = TypeVar("T")


def wait_until(
    predicate: Callable[[], T], timeout: float, *, interval: float = 0.05, what: str = ""
) -> T:
    """Call `predicate` until it returns something truthy, and return that; TimeoutError
    naming `what` (or the predicate) once `timeout` seconds have passed."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"not reached within {timeout:g} s: {what or _name(predicate)}")
        time.sleep(interval)


# Two signatures: with one `Callable[[], T | Awaitable[T]]`, mypy cannot tell T of an
# async predicate (bool, or the coroutine itself) and infers Never.
@overload
async def wait_until_async(
    predicate: Callable[[], Awaitable[T]], timeout: float, *, interval: float = ..., what: str = ...
) -> T: ...
@overload
async def wait_until_async(
    predicate: Callable[[], T], timeout: float, *, interval: float = ..., what: str = ...
) -> T: ...
async def wait_until_async(
    predicate: Callable[[], T | Awaitable[T]],
    timeout: float,
    *,
    interval: float = 0.01,
    what: str = "",
) -> T:
    """`wait_until` for an event loop: `predicate` may be a plain or an async function."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value  # type: ignore[return-value]
        if loop.time() >= deadline:
            raise TimeoutError(f"not reached within {timeout:g} s: {what or _name(predicate)}")
        await asyncio.sleep(interval)


def _name(predicate: Callable[..., object]) -> str:
    """The predicate's source line (a lambda's name says nothing), else its name."""
    try:
        return inspect.getsource(predicate).strip()
    except (OSError, TypeError):
        return getattr(predicate, "__qualname__", repr(predicate))
