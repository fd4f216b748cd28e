"""One request's run, from admission to its one final message.

The request is admitted, then tried in attempts until one streams it to its end. Each
attempt is started by the serving path (router/serving/run/paths.py) and streamed
(router/serving/run/streaming.py). An attempt that is lost (`WorkerLost`) is followed by
the next: after streamed tokens a migration or a resume, else a retry on other workers,
until the attempts or migrations are spent. Whatever ends the request (its end, a
server abort, an error, a refusal, the client leaving), it ends here, once. Each step is
an event for the serving core's observers (router/serving/events.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from engine.core.outputs import FinalResult, TextChunk
from engine.core.request import FinishReason
from router.serving.config import RouterConfig
from router.serving.errors import NotReadyError, QueueFullError, ResumeNotFoundError
from router.serving.events import RequestObserver
from router.serving.interfaces import AttemptBook, Followers, Path, Slots, Streamer
from router.serving.protocol import GenerateCall, server_abort
from router.serving.run.attempts import Attempt, ClientRequest, WorkerLost, final_result
from router.serving.run.migrations import migrates
from router.serving.run.resume import Resumed, Resumer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServingParts:
    """What every request's run uses, made once by the serving core."""

    intake: Callable[[GenerateCall], ClientRequest]  # validates and tokenizes, or raises
    admission: Slots
    attempts: AttemptBook
    path: Path
    streamer: Streamer
    delivery: Followers
    observer: RequestObserver
    config: RouterConfig
    shutting_down: Callable[[], bool]
    resumer: Resumer  # a resumed call's request, taken over (router/serving/run/resume.py)


class RequestRun:
    """One request; `outputs()` streams its chunks, then exactly one FinalResult."""

    request: ClientRequest  # what the intake made of the call, as the run starts

    def __init__(self, call: GenerateCall, parts: ServingParts) -> None:
        self.call = call
        self.parts = parts
        self.attempt: Attempt | None = None  # the latest
        self.finished = False  # its final message is out, or it was refused
        self.run_locally = False  # the next attempt runs its prompt on the decode worker
        self.num_failed = 0  # lost attempts other than migrations

    async def outputs(self) -> AsyncIterator[TextChunk | FinalResult]:
        parts = self.parts
        request = self.request = parts.intake(self.call)
        events = parts.observer
        events.arrived(request)
        try:
            async with parts.admission.slot(priority=request.base.priority):
                events.admitted(request)
                resumed: Resumed | None = None
                if self.call.resume_from_tokens is not None:  # a broken stream, picked up
                    resumed = await parts.resumer.take_over(self.call, request)
                for number in itertools.count():
                    try:
                        if number == 0 and resumed is not None:
                            attempt = self.attempt = resumed.attempt
                            chunks = resumed.chunks
                        else:
                            attempt = self._begin(number)
                            start = await parts.path.start(request, attempt, self.run_locally)
                            chunks = parts.streamer.stream(request, attempt, start)
                        async for chunk in chunks:
                            yield chunk
                        yield self._completed()
                        return
                    except WorkerLost as exc:
                        final = await self._after_loss(attempt, exc)
                        if final is not None:
                            yield final
                            return
        except asyncio.CancelledError as exc:
            abort = server_abort(exc)
            if abort is None:
                raise  # the client cancelled or left: nobody to tell
            # The server ends the call (a drain past its grace): this request's one
            # terminal message says what it had (usage, timings), and it ends everywhere.
            yield self._ended(FinishReason.ABORT, abort.reason)
        except (QueueFullError, NotReadyError, ResumeNotFoundError) as exc:
            self.finished = True  # refused at the door: nothing to abort, not a cancellation
            log.info("request %s refused: %s", request.request_id, exc)
            events.ended(request, None, f"refused: {exc}")
            raise
        except Exception as exc:  # noqa: BLE001 - becomes this request's terminal message
            log.error("request %s failed: %s", request.request_id, exc)
            yield self._ended(FinishReason.ERROR, str(exc))
        finally:
            self._close()

    def _begin(self, number: int) -> Attempt:
        # A worker that became live since the request arrived (a replacement, a scale-up)
        # may be where this attempt lands: follow it first.
        self.parts.delivery.ensure_pollers()
        self.attempt = self.parts.attempts.begin(self.request, number)
        return self.attempt

    def _completed(self) -> FinalResult:
        """The stream ran to the request's end."""
        self.finished = True
        result = final_result(self.request, self.request.progress.finish_reason)
        self.parts.observer.finished(self.request, result)
        return result

    def _ended(self, reason: FinishReason, error: str) -> FinalResult:
        """The request ends before its stream did: its final message says why."""
        self.finished = True
        if self.attempt is not None:
            self.parts.attempts.end(self.attempt)
        result = final_result(self.request, reason, error)
        self.parts.observer.ended(self.request, result, "")
        return result

    async def _after_loss(self, attempt: Attempt, exc: WorkerLost) -> FinalResult | None:
        """An attempt was lost: the request's final message when it may not go on (the
        service is going down); None when the next attempt continues it. Raises when the
        attempts or migrations are spent."""
        request, progress, config = self.request, self.request.progress, self.parts.config
        self.parts.observer.lost(request, attempt, exc)
        self.parts.attempts.end(attempt)
        if self.parts.shutting_down():
            log.info("request %s ends with the service: %s", request.request_id, exc)
            return self._ended(FinishReason.ABORT, f"server shutting down: {exc}")
        self.run_locally = exc.run_locally
        source = migrates(request.request_id, exc, progress, config.max_migrations)
        if source is not None:
            self.parts.observer.migrated(source, exc.why, 1)
            return None  # straight on: the client is waiting mid-stream
        self.num_failed += 1
        if self.num_failed >= config.max_attempts:
            raise RuntimeError(f"gave up after {config.max_attempts} attempts: {exc}") from exc
        if progress.num_out:
            progress.num_resumed += 1
        log.warning(
            "request %s: %s; %s",
            request.request_id,
            exc,
            f"resuming after {progress.num_out} tokens"
            if progress.num_out
            else "retrying on other workers",
        )
        if not self.run_locally:
            await asyncio.sleep(config.retry_delay_s * self.num_failed)
        return None

    def _close(self) -> None:
        """However the request ended: its last attempt is over (and aborted everywhere
        unless the request finished), and a request that was not is cancelled."""
        request = self.request
        attempt = self.attempt
        # A resumable call's request outlives its broken stream, for a while.
        if attempt is not None and (
            self.finished or not self.parts.resumer.let_go(self.call, attempt, request.progress)
        ):
            self.parts.attempts.end(attempt, abort=not self.finished)
        if not self.finished:
            traced = f" trace={request.trace_id}" if request.trace_id else ""
            num_out = request.progress.num_out
            log.info("request %s cancelled after %d tokens%s", request.request_id, num_out, traced)
            self.parts.observer.ended(request, None, "cancelled")
