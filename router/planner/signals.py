"""What the serving core records for the planner, as requests run.

`SignalsObserver`, one of the serving core's observers (router/serving/events.py),
records its events here as they happen (each a few dictionary operations, and everything
kept is bounded whether a planner reads it or not); the planner's loop takes the
interval's share with `take()`:

* requests: arrivals, the uncached tokens of each prompt that is the prefill pool's
  work (sent there, or run locally because it was saturated), first tokens (TTFT),
  completions (output tokens, TPOT), and which requests still wait for a first token;
* prefill replies: spans in which a worker was busy throughout, with the prompts it
  answered in them (its throughput under load), and prompts that found it idle;
* decode token batches: one step's time with the batch's size and context.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from router.planner.snapshot import DecodeSample, PrefillSample, Traffic
from router.serving.events import BaseObserver, DisaggregatedRoute, PrefillReply, Route

if TYPE_CHECKING:
    from engine.core.outputs import FinalResult
    from engine.wire import WorkerStats
    from router.serving.run.attempts import Attempt, ClientRequest
    from router.serving.workers import WorkerRef

MAX_SAMPLES = 4096  # per kind and interval; beyond it the oldest go
BUSY_SPAN_S = 0.5  # replies of one engine step come together: a span covers several steps


@dataclass
class _BusySpan:
    """One prefill worker's current span of uninterrupted work."""

    start: float
    num_prompts: int = 0
    num_tokens: int = 0
    sum_sq_tokens: int = 0


class ServingSignals:
    """The serving core's record of traffic and worker speed, handed over per interval."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._waiting: dict[Hashable, float] = {}  # request → arrival, until its first token
        self._spans: dict[str, _BusySpan] = {}
        self._since = clock()
        self._reset()

    def _reset(self) -> None:
        self._num_arrivals = self._num_prompts = self._prompt_tokens = self._sum_sq = 0
        self._num_finished = self._output_tokens = 0
        self._ttft: deque[float] = deque(maxlen=MAX_SAMPLES)
        self._tpot: deque[float] = deque(maxlen=MAX_SAMPLES)
        self._prefill: deque[PrefillSample] = deque(maxlen=MAX_SAMPLES)
        self._decode: deque[DecodeSample] = deque(maxlen=MAX_SAMPLES)

    # ---------------------------------------------------------------- requests
    # A request is known by any key that is its own while it runs (the serving core
    # gives its `Progress`).
    def request_arrived(self, key: Hashable) -> None:
        self._num_arrivals += 1
        self._waiting[key] = self._clock()

    def prompt_placed(self, num_uncached: int, prefill_work: bool) -> None:
        """A prompt was sent to run. prefill_work: it is the prefill pool's to run (sent
        there, or run on a decode worker only because the prefill pool was saturated or
        had no worker for it), not a short prompt a decode worker takes by design."""
        if not prefill_work:
            return
        self._num_prompts += 1
        self._prompt_tokens += num_uncached
        self._sum_sq += num_uncached * num_uncached

    def first_token(self, key: Hashable, ttft_s: float) -> None:
        if self._waiting.pop(key, None) is not None:
            self._ttft.append(ttft_s)

    def request_ended(
        self, key: Hashable, num_out: int, tpot_s: float | None, completed: bool
    ) -> None:
        """A request's end, however it ended; only completed ones count their output."""
        self._waiting.pop(key, None)
        if completed:
            self._num_finished += 1
            self._output_tokens += num_out
            if tpot_s is not None:
                self._tpot.append(tpot_s)

    # ---------------------------------------------------------------- workers
    def prefill_reply(
        self, worker_id: str, num_tokens: int, prefill_s: float, busy_since: float, was_idle: bool
    ) -> None:
        """A prefill reply for num_tokens uncached tokens. busy_since: when the worker last
        went from idle to busy in the router's count (time.monotonic); was_idle: this
        prompt found it idle, so its prefill time is its own."""
        now = self._clock()
        if was_idle and prefill_s > 0:
            self._prefill.append(PrefillSample(1, num_tokens, num_tokens**2, prefill_s))
        span = self._spans.get(worker_id)
        if span is None or busy_since > span.start:
            span = self._spans[worker_id] = _BusySpan(max(busy_since, now - prefill_s))
        span.num_prompts += 1
        span.num_tokens += num_tokens
        span.sum_sq_tokens += num_tokens**2
        if now - span.start >= BUSY_SPAN_S:
            self._prefill.append(
                PrefillSample(
                    span.num_prompts, span.num_tokens, span.sum_sq_tokens, now - span.start
                )
            )
            self._spans[worker_id] = _BusySpan(now)

    def decode_step(self, batch_size: int, context_tokens: int, step_s: float) -> None:
        self._decode.append(DecodeSample(batch_size, context_tokens, step_s))

    # ---------------------------------------------------------------- the planner's side
    def take(
        self, slo_ttft_s: float
    ) -> tuple[Traffic, tuple[PrefillSample, ...], tuple[DecodeSample, ...]]:
        """The interval since the last call: its traffic and the workers' samples."""
        now = self._clock()
        waits = [now - t for t in self._waiting.values()]
        traffic = Traffic(
            seconds=max(now - self._since, 1e-9),
            num_arrivals=self._num_arrivals,
            num_prompts=self._num_prompts,
            prompt_tokens=self._prompt_tokens,
            sum_sq_prompt_tokens=self._sum_sq,
            num_finished=self._num_finished,
            output_tokens=self._output_tokens,
            ttft_s=tuple(self._ttft),
            tpot_s=tuple(self._tpot),
            oldest_waiting_s=max(waits, default=0.0),
            num_waiting_past_ttft=sum(1 for w in waits if w > slo_ttft_s),
        )
        samples = tuple(self._prefill), tuple(self._decode)
        self._since = now
        self._reset()
        return traffic, *samples


class SignalsObserver(BaseObserver):
    """The serving core's events, as the planner's signals (a request is known by its
    `ClientRequest`)."""

    def __init__(self, signals: ServingSignals) -> None:
        self.signals = signals

    def arrived(self, request: ClientRequest) -> None:
        self.signals.request_arrived(request)

    def routed(self, attempt: Attempt, route: Route) -> None:
        if isinstance(route, DisaggregatedRoute):
            self.signals.prompt_placed(route.placed_tokens, prefill_work=route.prefill_work)

    def prefilled(self, attempt: Attempt, reply: PrefillReply) -> None:
        self.signals.prefill_reply(
            reply.worker.worker_id,
            reply.num_uncached,
            reply.result.prefill_s,
            reply.busy_since,
            reply.was_idle,
        )

    def first_token(self, request: ClientRequest) -> None:
        progress = request.progress
        if progress.t_first is not None:
            self.signals.first_token(request, progress.t_first - progress.arrival)

    def finished(self, request: ClientRequest, result: FinalResult) -> None:
        progress = request.progress
        self.signals.request_ended(request, progress.num_out, progress.tpot_s(), completed=True)

    def ended(self, request: ClientRequest, result: FinalResult | None, outcome: str) -> None:
        self.signals.request_ended(request, request.progress.num_out, None, completed=False)

    def decode_step(self, worker: WorkerRef, stats: WorkerStats, step_s: float) -> None:
        context_tokens = stats.num_blocks_in_use * worker.info.layout.block_size
        self.signals.decode_step(stats.num_running, context_tokens, step_s)
