"""The two ways an attempt starts, up to the point its stream takes over
(router/serving/run/streaming.py):

* Colocated: the request goes to one colocated replica, which runs it whole.
* Disaggregated: pick the decode worker, decide where the prompt runs
  (router/routing/placement.py); for a remote prefill, reserve on decode and run the prompt
  on prefill at the same time (no round trip first), stream the first token when it is
  sampled, and let the KV land behind it. The router renews the reservation while the
  prompt waits or runs, so a long prefill queue never expires it.

Each path is handed what it uses: where workers are chosen (`Placement`), how they are
called (`Calls`), who hears where the attempt went (`RequestObserver`), and for the
disaggregated one where a prefill's KV events go and which reservations are renewed.
"""

from __future__ import annotations

import asyncio
import time

from engine.core.outputs import PhaseTimings
from engine.core.request import FinishReason
from engine.wire import HandoffTarget, PoolName, PrefillResult, Reservation
from router.fleet.clients import WorkerDied
from router.serving.config import RouterConfig
from router.serving.events import ColocatedRoute, DisaggregatedRoute, PrefillReply, RequestObserver
from router.serving.interfaces import Calls, KVEventSink, Placement, Renewals, Started
from router.serving.run.attempts import Attempt, ClientRequest, WorkerLost
from router.serving.workers import WorkerRef


class ColocatedPath:
    """The request runs whole on one colocated replica."""

    def __init__(self, placement: Placement, calls: Calls, observer: RequestObserver) -> None:
        self.placement = placement
        self.calls = calls
        self.observer = observer

    async def start(self, request: ClientRequest, attempt: Attempt, run_locally: bool) -> Started:
        hashes = self.placement.hash_prompt(PoolName.COLOCATED, attempt.inp.prompt_token_ids)
        while True:
            ref = await self.placement.token_worker(PoolName.COLOCATED, hashes)
            attempt.decode_ref = ref  # before submit: tokens may come back at once
            self.observer.routed(
                attempt, ColocatedRoute(ref.worker_id, self.placement.routing_policy)
            )
            attempt.leases.append(ref.load.lease())
            try:
                await ref.client.submit(attempt.inp)
                break
            except WorkerDied as exc:
                attempt.leases.pop().release()
                self.calls.died(ref, exc)
        request.progress.mark_decoding(PhaseTimings(queued_s=request.progress.since_arrival()))
        return Started()


class DisaggregatedPath:
    """The prompt runs on the prefill pool (its KV handed to the decode worker) or, where
    the policy says so, on the decode worker itself."""

    def __init__(
        self,
        placement: Placement,
        calls: Calls,
        kv_events: KVEventSink,
        renewals: Renewals,
        observer: RequestObserver,
        config: RouterConfig,
    ) -> None:
        self.placement = placement
        self.calls = calls
        self.kv_events = kv_events
        self.renewals = renewals
        self.observer = observer
        self.config = config

    async def start(self, request: ClientRequest, attempt: Attempt, run_locally: bool) -> Started:
        inp = attempt.inp
        hashes = self.placement.hash_prompt(PoolName.PREFILL, inp.prompt_token_ids)
        decode_ref = await self.placement.token_worker(PoolName.DECODE, hashes)
        attempt.decode_ref = decode_ref
        decision, prefill_ref, num_uncached = self.placement.prompt_path(
            inp, hashes, decode_ref, run_locally
        )
        queued_s = request.progress.since_arrival()
        if prefill_ref is None:
            num_placed = len(inp.prompt_token_ids) - self.placement.num_cached(decode_ref, hashes)
            # A short prompt's time is mostly fixed cost: it neither prices local prefill
            # nor counts as prefill work for the planner.
            prefill_work = decision.reason != "short_prompt"
        else:
            num_placed, prefill_work = num_uncached, True
        route = DisaggregatedRoute(
            decode_worker=decode_ref.worker_id,
            prefill_worker=prefill_ref.worker_id if prefill_ref is not None else "",
            path=decision.path,
            reason=decision.reason,
            uncached_tokens=num_uncached,
            placed_tokens=num_placed,
            prefill_work=prefill_work,
        )
        self.observer.routed(attempt, route)
        if prefill_ref is None:
            return await self._local(request, attempt, decode_ref, route, queued_s)
        return await self._remote(request, attempt, decode_ref, prefill_ref, num_uncached, queued_s)

    async def _local(
        self,
        request: ClientRequest,
        attempt: Attempt,
        decode_ref: WorkerRef,
        route: DisaggregatedRoute,
        queued_s: float,
    ) -> Started:
        """The decode worker runs the prompt itself; no hand-off."""
        local = decode_ref.load.lease(route.placed_tokens, prices_local_prefill=route.prefill_work)
        attempt.leases.append(local)
        await self.calls.call(decode_ref, decode_ref.client.submit(attempt.inp))
        request.progress.mark_decoding(PhaseTimings(queued_s, local_prefill=True))
        return Started(local=local)

    async def _remote(
        self,
        request: ClientRequest,
        attempt: Attempt,
        decode_ref: WorkerRef,
        prefill_ref: WorkerRef,
        num_uncached: int,
        queued_s: float,
    ) -> Started:
        """The prefill worker runs the prompt and hands the KV to the decode worker."""
        attempt.leases.append(decode_ref.load.lease())
        attempt.prefill_ref = prefill_ref
        result, reservation = await self._prefill(attempt, decode_ref, prefill_ref, num_uncached)
        self.kv_events.apply_kv_events(prefill_ref, result.kv_events)
        progress = request.progress
        progress.mark_decoding(PhaseTimings(queued_s, result.prefill_s))
        progress.note_cached(attempt, result.num_cached_tokens)
        if result.finish_reason is FinishReason.ERROR:
            raise WorkerLost(result.error, run_locally=True)  # nothing was sent
        if result.finish_reason is FinishReason.ABORT:
            raise RuntimeError("prefill worker aborted the request")
        if result.finish_reason is not None:  # the first token ended it: free the reservation
            self.calls.abort(decode_ref, attempt.req_id)
        elif reservation is None:
            # The decode worker had no room: it refuses the KV. Stream the first token,
            # then continue from it in the decode worker's own queue.
            attempt.inbox.put(WorkerLost(f"no room on {decode_ref.worker_id}", run_locally=True))
        tokens = () if result.first_token is None else (result.first_token,)
        return Started(tokens, result.finish_reason)

    async def _prefill(
        self, attempt: Attempt, decode_ref: WorkerRef, prefill_ref: WorkerRef, num_uncached: int
    ) -> tuple[PrefillResult, Reservation | None]:
        """Reserve on decode and run the prompt on prefill at the same time.

        The prefill call is the one on the first token's path: it runs in this task, so
        its frame leaves before the reservation's task first runs, and no task of its
        own (as `asyncio.wait_for` would make) stands between the two."""
        inp = attempt.inp
        source = prefill_ref.worker_id
        reserving = asyncio.ensure_future(
            self.calls.call(decode_ref, decode_ref.client.reserve(inp, self.config.lease_s, source))
        )
        lease = prefill_ref.load.lease(num_uncached)
        # Renewed until the KV lands (the decode worker's first word on the request, in
        # the stream): a hand-off queued behind others on its channel is still progress.
        self.renewals.hold(decode_ref, inp.req_id)
        target = HandoffTarget(decode_ref.worker_id, decode_ref.info.epoch)
        try:
            async with asyncio.timeout(self.config.prefill_timeout_s):
                result = await self.calls.call(prefill_ref, prefill_ref.client.prefill(inp, target))
        except WorkerLost as exc:
            reserving.cancel()
            self.renewals.release(decode_ref, inp.req_id)
            raise WorkerLost(str(exc), run_locally=True) from exc
        except TimeoutError as exc:
            reserving.cancel()
            self.renewals.release(decode_ref, inp.req_id)
            raise RuntimeError(f"prefill took over {self.config.prefill_timeout_s:g} s") from exc
        finally:
            lease.release()
        load = prefill_ref.load
        load.prefill_rate.observe(
            num_uncached, result.prefill_s, time.monotonic(), load.busy_since, lease.was_idle
        )
        reply = PrefillReply(prefill_ref, result, num_uncached, load.busy_since, lease.was_idle)
        self.observer.prefilled(attempt, reply)  # as it came: the reservation may be later
        return result, await reserving
