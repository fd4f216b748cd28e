"""The two ways a request runs, as the serving core drives them (a part of
`router.serving.orchestrator.DisaggregatedGenerator`, kept apart so each file has one job).

* Colocated: the request goes to one colocated replica, which runs it whole.
* Disaggregated: pick the decode worker, decide where the prompt runs
  (`router/routing/placement.py`); for a remote prefill, reserve on decode and run the prompt
  on prefill at the same time (no round trip first), stream the first token when it is
  sampled, and let the KV land behind it. The router renews the reservation while the
  prompt waits or runs, so a long prefill queue never expires it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from engine.core.outputs import PhaseTimings, TextChunk
from engine.core.request import FinishReason
from engine.wire import HandoffTarget, PoolName, PrefillResult, Reservation
from router.fleet.clients import WorkerDied
from router.observability import metrics, phase_metrics
from router.planner.signals import ServingSignals
from router.routing.kv_index import PrefixIndex
from router.routing.placement import place_prompt, route_by_cache
from router.routing.prefill_policy import PathDecision, PrefillPolicyConfig
from router.routing.worker_load import WorkerLease
from router.serving.attempts import Attempt, Progress, WorkerLost
from router.serving.config import RouterConfig
from router.serving.delivery import TokenDelivery
from router.serving.workers import Pools, WorkerRef

T = TypeVar("T")


class ServingPaths:
    """The paths; the serving core provides the state and plumbing declared here."""

    pools: Pools
    config: RouterConfig
    prefill_policy: PrefillPolicyConfig
    indexes: dict[PoolName, PrefixIndex]
    delivery: TokenDelivery
    signals: ServingSignals
    block_size: int
    _renewing: dict[WorkerRef, set[str]]

    if TYPE_CHECKING:  # provided by the serving core

        async def _pick(
            self,
            candidates: Callable[[], Sequence[WorkerRef]],
            what: str,
            route: Callable[[Sequence[WorkerRef]], WorkerRef],
        ) -> WorkerRef: ...  # type: ignore[empty-body]

        async def _call(self, ref: WorkerRef, pending: Awaitable[T]) -> T: ...  # type: ignore[empty-body]

        def _spawn(self, coro: Any) -> None: ...

        async def _abort_on(self, ref: WorkerRef, req_id: str) -> None: ...

        def _stream(
            self,
            attempt: Attempt,
            progress: Progress,
            tokens: tuple[int, ...],
            reason: FinishReason | None,
            local: WorkerLease | None = None,
        ) -> AsyncIterator[TextChunk]: ...  # type: ignore[empty-body]

    async def _run_colocated(
        self, attempt: Attempt, progress: Progress
    ) -> AsyncIterator[TextChunk]:
        hashes = self.indexes[PoolName.COLOCATED].hash_prompt(attempt.inp.prompt_token_ids)
        while True:
            ref = await self._pick(
                lambda: self.pools.routable(PoolName.COLOCATED),
                PoolName.COLOCATED,
                route_by_cache(self.indexes[PoolName.COLOCATED], hashes, self.config.routing),
            )
            attempt.decode_ref = ref  # before submit: tokens may come back at once
            attempt.trace.routed(worker=ref.worker_id, policy=self.config.routing.policy)
            attempt.leases.append(ref.load.lease())
            try:
                await ref.client.submit(attempt.inp)
                break
            except WorkerDied as exc:
                attempt.leases.pop().release()
                self.pools.mark_dead(ref, f"{ref.worker_id} died: {exc}")
        progress.mark_decoding(PhaseTimings(queued_s=progress.since_arrival()))
        async for chunk in self._stream(attempt, progress, (), None):
            yield chunk

    async def _run_disaggregated(
        self, attempt: Attempt, progress: Progress, run_locally: bool
    ) -> AsyncIterator[TextChunk]:
        inp = attempt.inp
        hashes = self.indexes[PoolName.PREFILL].hash_prompt(inp.prompt_token_ids)
        decode_ref = await self._pick(
            lambda: self.pools.routable(PoolName.DECODE),
            PoolName.DECODE,
            route_by_cache(self.indexes[PoolName.DECODE], hashes, self.config.routing),
        )
        attempt.decode_ref = decode_ref
        if run_locally:
            decision, prefill_ref, num_uncached = PathDecision("local", "prefill_failed"), None, 0
        else:
            decision, prefill_ref, num_uncached = place_prompt(
                num_prompt=len(inp.prompt_token_ids),
                max_tokens=inp.sampling.max_tokens,
                hashes=hashes,
                decode_ref=decode_ref,
                prefill_candidates=[
                    w
                    for w in self.pools.routable(PoolName.PREFILL)
                    if decode_ref.worker_id in w.peers
                ],
                indexes=self.indexes,
                routing=self.config.routing,
                policy=self.prefill_policy,
                block_size=self.block_size,
            )
        metrics.prefill_path(decision.path, decision.reason)
        attempt.trace.routed(
            decode_worker=decode_ref.worker_id,
            prefill_worker=prefill_ref.worker_id if prefill_ref is not None else "",
            path=decision.path,
            reason=decision.reason,
            uncached_tokens=num_uncached,
        )
        queued_s = progress.since_arrival()
        if prefill_ref is None:
            # Local path: the decode worker runs the prompt itself; no hand-off.
            num_local = len(inp.prompt_token_ids) - self.indexes[PoolName.DECODE].num_cached_tokens(
                decode_ref.index, hashes
            )
            # A short prompt's time is mostly fixed cost: it neither prices local prefill
            # nor counts as prefill work for the planner.
            prefill_work = decision.reason != "short_prompt"
            local = decode_ref.load.lease(num_local, prices_local_prefill=prefill_work)
            attempt.leases.append(local)
            self.signals.prompt_placed(num_local, prefill_work=prefill_work)
            await self._call(decode_ref, decode_ref.client.submit(inp))
            progress.mark_decoding(PhaseTimings(queued_s, local_prefill=True))
            async for chunk in self._stream(attempt, progress, (), None, local):
                yield chunk
            return
        attempt.leases.append(decode_ref.load.lease())
        attempt.prefill_ref = prefill_ref
        self.signals.prompt_placed(num_uncached, prefill_work=True)
        result, reservation = await self._prefill(attempt, decode_ref, prefill_ref, num_uncached)
        attempt.trace.prefilled(prefill_ref.worker_id, result)
        phase_metrics.observe(prefill_ref.pool, prefill_ref.index, result.phases)
        self.delivery.apply_kv_events(prefill_ref, result.kv_events)
        progress.mark_decoding(PhaseTimings(queued_s, result.prefill_s))
        progress.note_cached(attempt, result.num_cached_tokens)
        if result.finish_reason is FinishReason.ERROR:
            metrics.kv_transfer_failed()
            raise WorkerLost(result.error, run_locally=True)  # nothing was sent
        if result.finish_reason is FinishReason.ABORT:
            raise RuntimeError("prefill worker aborted the request")
        if result.transfer_bytes:
            metrics.observe_kv_transfer(result.transfer_bytes)
        if result.finish_reason is not None:  # the first token ended it: free the reservation
            self._spawn(self._abort_on(decode_ref, attempt.req_id))
        elif reservation is None:
            # The decode worker had no room: it refuses the KV. Stream the first token,
            # then continue from it in the decode worker's own queue.
            attempt.inbox.put(WorkerLost(f"no room on {decode_ref.worker_id}", run_locally=True))
        tokens = () if result.first_token is None else (result.first_token,)
        async for chunk in self._stream(attempt, progress, tokens, result.finish_reason):
            yield chunk

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
            self._call(decode_ref, decode_ref.client.reserve(inp, self.config.lease_s, source))
        )
        lease = prefill_ref.load.lease(num_uncached)
        # Renewed until the KV lands (the decode worker's first word on the request, in
        # `_stream`): a hand-off queued behind others on its channel is still progress.
        self._renewing[decode_ref].add(inp.req_id)
        target = HandoffTarget(decode_ref.worker_id, decode_ref.info.epoch)
        try:
            async with asyncio.timeout(self.config.prefill_timeout_s):
                result = await self._call(prefill_ref, prefill_ref.client.prefill(inp, target))
        except WorkerLost as exc:
            reserving.cancel()
            self._renewing[decode_ref].discard(inp.req_id)
            raise WorkerLost(str(exc), run_locally=True) from exc
        except TimeoutError as exc:
            reserving.cancel()
            self._renewing[decode_ref].discard(inp.req_id)
            raise RuntimeError(f"prefill took over {self.config.prefill_timeout_s:g} s") from exc
        finally:
            lease.release()
        load = prefill_ref.load
        load.prefill_rate.observe(
            num_uncached, result.prefill_s, time.monotonic(), load.busy_since, lease.was_idle
        )
        self.signals.prefill_reply(
            prefill_ref.worker_id, num_uncached, result.prefill_s, load.busy_since, lease.was_idle
        )
        return result, await reserving
