"""Blocking calls that may never return (to a Ray that is going down, a child that
never answers), run off the event loop on daemon threads.

The loop's default executor would do the same while the call returns, but asyncio.run
waits for its threads at exit: one call hung on a dead GCS would hold the process
for Ray's reconnect timeout (a minute). A daemon thread is left behind instead.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


async def call_in_daemon_thread(fn: Callable[[], T], name: str) -> T:
    """`fn()` on a daemon thread of its own; its result or its exception. Cancelling the
    wait leaves the thread to finish (or not) on its own."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting coroutine
            loop.call_soon_threadsafe(settle, None, exc)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    threading.Thread(target=run, name=name, daemon=True).start()
    return await future
