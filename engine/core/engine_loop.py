"""Runs an EngineCore on its own thread so a worker's event loop never blocks on a step.

Everything that touches engine state (adding, aborting, reserving, reading the
cache) is submitted as a command and runs on the engine thread between steps,
so the scheduler needs no locks and aborts take effect at a step boundary.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from engine.core.engine_core import EngineCore
from engine.wire import TokenUpdate

log = logging.getLogger(__name__)
T = TypeVar("T")

UpdateSink = Callable[[list[TokenUpdate]], None]


class EngineLoop:
    """`schedule() -> execute -> update` forever, with commands applied between steps."""

    def __init__(self, core: EngineCore, on_updates: UpdateSink, name: str = "engine") -> None:
        self.core = core
        self._on_updates = on_updates
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = (
            queue.SimpleQueue()
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put((lambda: None, Future()))  # wake the thread
        self._thread.join(timeout)

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Run fn on the engine thread at the next step boundary."""
        fut: Future[T] = Future()
        if self.error is not None:
            fut.set_exception(RuntimeError(f"engine loop died: {self.error!r}"))
            return fut
        self._commands.put((fn, fut))
        return fut

    def _drain(self, block: bool) -> None:
        try:
            fn, fut = self._commands.get(block=block, timeout=0.5 if block else None)
        except queue.Empty:
            return
        while True:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 - the caller gets it
                    fut.set_exception(exc)
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                # Idle: sleep until a command arrives instead of spinning.
                self._drain(block=not self.core.has_unfinished)
                if not self.core.has_unfinished:
                    continue
                updates = self.core.step()
                if updates:
                    self._on_updates(updates)
        except BaseException as exc:
            log.exception("engine loop crashed")
            self.error = exc
            self._fail_pending(exc)

    def _fail_pending(self, exc: BaseException) -> None:
        while True:
            try:
                _, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if fut.set_running_or_notify_cancel():
                fut.set_exception(RuntimeError(f"engine loop died: {exc!r}"))
