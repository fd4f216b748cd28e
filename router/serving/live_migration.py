"""Live migration: a draining decode worker hands its running requests, KV and all, to
peer decode workers while their streams go on.

When a decode worker starts draining (`pdserve scale --decode N-1`, `DrainWorker`), the
requests running on it are spread over the other decode workers and move together:

1. the channels source → target are made, all at once, where they are not there yet
   (router/serving/peer_links.py: once per pair and incarnation; the same transfer
   interface and header/epoch checks as a prefill hand-off, with the source as the
   sending end);
2. one `detach` call on the source takes them all off its schedule at one step
   boundary, keeping their blocks, and returns each one's tokens so far;
3. each stream switches to a new attempt id on its target (an inbox marker, `Moved`,
   carries the tokens the client may not have seen yet, so none is lost or repeated);
4. one `reserve_many` call per target holds blocks for the KV of all but the last token
   of each, under a lease, for the new ids;
5. one `send_detached` per target gathers the blocks of all its requests, frees them
   and posts them on the channel in as few messages as the size cap allows; the target
   checks each entry against its reservation and continues each request from its last
   sampled token, with the same seed (sampling depends on seed and absolute position,
   so the text is the one it would have been).

A request is paused from step 2 to the target's first step: one round, whose transfer
is shared by every request going to that target. Where a step
fails (no channel, no room, a worker lost), the request moves by recompute instead
(router/serving/run/migrations.py, reason `drained`). The drain then returns once every request has
left. Counted in `pdserve_request_migrations_total{pool="decode", reason="drained_kv"}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from engine.wire import (
    DetachedMove,
    DetachedRequest,
    GenerationInput,
    HandoffTarget,
    PoolName,
    Precopy,
)
from router.fleet.clients import WorkerDied
from router.serving.config import RouterConfig
from router.serving.events import RequestObserver
from router.serving.inbox import Moved
from router.serving.peer_links import PeerLinks
from router.serving.run.attempts import Attempt, WorkerLost
from router.serving.workers import Pools, WorkerRef

log = logging.getLogger(__name__)


# Why requests move: their worker drains, or an operator rebalances (MigrateRequests).
MoveReason = Literal["drained", "rebalanced"]


class _Outcome(enum.Enum):
    """What became of a request that did not get ready to move with its KV."""

    RECOMPUTED = "recomputed"  # continues elsewhere from its streamed tokens
    ENDED = "ended"  # finished or was cancelled meanwhile
    STAYED = "stayed"  # not running there, or no channel: left where it is (rebalance)


@dataclass(frozen=True)
class MoveResult:
    """A move's result: requests picked, moved with their KV, moved by recompute."""

    num_candidates: int
    with_kv: int
    by_recompute: int


@dataclass(frozen=True)
class _Prepared:
    """A request detached from the draining worker and reserved for on its target."""

    attempt: Attempt
    target: WorkerRef
    move: DetachedMove
    paused: float  # perf_counter when it left the source's schedule


class LiveMigrator:
    """Moves requests off draining decode workers (the pools' drain hook)."""

    def __init__(
        self,
        pools: Pools,
        attempts: dict[str, Attempt],
        config: RouterConfig,
        spawn: Callable[[Any], None],
        observer: RequestObserver,
    ) -> None:
        self.pools = pools
        self.attempts = attempts
        self.config = config
        self.spawn = spawn
        self.observer = observer  # told of the requests that moved with their KV
        self._num_moves = 0
        # Attempts (by id) a move has picked: a drain and a rebalance of one worker at
        # once must not both take a request.
        self._moving: set[int] = set()
        pools.drain_hooks.append(self._on_drain)
        self.links = PeerLinks(pools, spawn, eager=config.decode_peer_channels == "eager")

    async def _on_drain(self, source: WorkerRef) -> None:
        await self.drain(source)

    async def drain(self, source: WorkerRef) -> MoveResult:
        """Move every request on `source` to the other decode workers; once it returns,
        none of them needs `source` or its channels any more."""
        on_it = [a for a in list(self.attempts.values()) if a.decode_ref is source]
        if source.pool is not PoolName.DECODE or not on_it:
            return MoveResult(len(on_it), 0, 0)
        return await self.move_off(source, on_it, "drained")

    async def rebalance(self, source: WorkerRef, max_requests: int | None) -> MoveResult:
        """Move up to `max_requests` (None: all) of the requests decoding on `source`,
        the largest token budgets first (those likely to run longest), to the other
        decode workers; `source` stays in service. A request not decoding there yet
        stays (`MigrateRequests`)."""
        return await self.move_off(source, self._longest_first(source)[:max_requests], "rebalanced")

    def budgets(self, source: WorkerRef) -> list[int]:
        """The token budgets of the requests on `source`, in the order `rebalance` picks
        them: what a router tier compares to pick the service's largest (router/tier)."""
        return [a.inp.sampling.max_tokens for a in self._longest_first(source)]

    def _longest_first(self, source: WorkerRef) -> list[Attempt]:
        on_it = [a for a in list(self.attempts.values()) if a.decode_ref is source]
        on_it.sort(key=lambda a: a.inp.sampling.max_tokens, reverse=True)
        return on_it

    async def move_off(
        self, source: WorkerRef, attempts: list[Attempt], reason: MoveReason
    ) -> MoveResult:
        """Move `attempts` off `source` to its live peers, together. A request that is
        not running there (queued, waiting for its KV, finishing) continues elsewhere by
        recompute when `source` drains, and stays when it is only rebalanced. Counted in
        the migrations metric as `{reason}_kv`, or `reason` for a recompute. A request
        another move has picked already is left to it."""
        attempts = [a for a in attempts if id(a) not in self._moving]
        picked = {id(a) for a in attempts}
        self._moving |= picked
        try:
            return await self._move_together(source, attempts, reason)
        finally:
            self._moving -= picked

    async def _move_together(
        self, source: WorkerRef, attempts: list[Attempt], reason: MoveReason
    ) -> MoveResult:
        peers = [w for w in self.pools.routable(PoolName.DECODE) if w is not source]
        if not peers:
            log.info("%s: no peer to take its requests; they stay", source.worker_id)
            return MoveResult(len(attempts), 0, 0)
        # Spread them: each to the peer with the fewest requests, counting those sent.
        planned = {id(w): w.num_assigned for w in peers}
        targets = []
        for _ in attempts:
            target = min(peers, key=lambda w: planned[id(w)])
            planned[id(target)] += 1
            targets.append(target)
        started = time.perf_counter()
        # Channels to every target at once (each made once per pair of incarnations).
        links = {id(t): asyncio.ensure_future(self.links.link(source, t)) for t in targets}
        new_ids = [self._new_id(a) for a in attempts]
        moves = list(zip(attempts, targets, new_ids, strict=True))
        await self._precopy(source, moves, links)
        prepared = await self._prepare(source, moves, links, reason)
        by_target: dict[int, list[_Prepared]] = {}
        num_recomputed = 0
        for item, target, new_id in zip(prepared, targets, new_ids, strict=True):
            if not isinstance(item, _Prepared):  # a pre-copy it had there is not needed
                self.spawn(self._abort(target, new_id))
            if isinstance(item, BaseException):
                log.error("moving a request off %s failed: %r", source.worker_id, item)
            elif isinstance(item, _Prepared):
                by_target.setdefault(id(item.target), []).append(item)
            elif item is _Outcome.RECOMPUTED:
                num_recomputed += 1
        # One transfer per target for all its requests: the per-message costs once.
        sent = await asyncio.gather(
            *(self._send(source, group, reason) for group in by_target.values()),
            return_exceptions=True,
        )
        for failed in (r for r in sent if isinstance(r, BaseException)):
            log.error("moving requests off %s failed: %r", source.worker_id, failed)
        moved = sum(r for r in sent if isinstance(r, int))
        num_recomputed += sum(len(g) for g in by_target.values()) - moved
        log.info(
            "%s: %d of %d requests moved with their KV in %.3f s",
            source.worker_id,
            moved,
            len(attempts),
            time.perf_counter() - started,
        )
        return MoveResult(len(attempts), moved, num_recomputed)

    def _new_id(self, attempt: Attempt) -> str:
        """The id a request continues under on its target (a new attempt)."""
        self._num_moves += 1
        return f"{attempt.inp.req_id.split('-')[0]}-k{self._num_moves}"

    async def _precopy(
        self,
        source: WorkerRef,
        moves: list[tuple[Attempt, WorkerRef, str]],
        links: Mapping[int, asyncio.Future[None]],
    ) -> None:
        """The first round: every request's full blocks go to its target while it keeps
        decoding on `source`, one transfer per target; the final round then sends only
        the blocks after them, so a request pauses for a few blocks, not its whole KV.
        A pre-copy that fails costs nothing but time: its request moves whole."""
        by_target: dict[int, tuple[WorkerRef, list[Precopy]]] = {}
        for attempt, target, new_id in moves:
            by_target.setdefault(id(target), (target, []))[1].append(
                Precopy(attempt.req_id, new_id)
            )

        async def one(target: WorkerRef, group: list[Precopy]) -> None:
            try:
                await asyncio.shield(links[id(target)])
                await source.client.precopy(
                    HandoffTarget(target.worker_id, target.info.epoch), group
                )
            except Exception as exc:  # noqa: BLE001 - then each moves whole
                log.info("pre-copy %s → %s skipped: %s", source.worker_id, target.worker_id, exc)

        await asyncio.gather(*(one(t, group) for t, group in by_target.values()))

    async def _prepare(
        self,
        source: WorkerRef,
        moves: list[tuple[Attempt, WorkerRef, str]],
        links: Mapping[int, asyncio.Future[None]],
        reason: MoveReason,
    ) -> list[_Prepared | _Outcome | BaseException]:
        """Detach the requests (those whose target has a channel) in one call, at one
        step boundary, switch each stream to its target and reserve its blocks there,
        one call per target; for each, its move or what became of it. One call each
        way, not one per request: a request's pause ends with the slowest of its group,
        so the group's calls should not queue behind one another."""
        stay_if_not_running = reason == "rebalanced"  # the source stays in service
        targets = {id(t): t for _, t, _ in moves}
        made = await asyncio.gather(
            *(asyncio.shield(links[key]) for key in targets), return_exceptions=True
        )
        no_channel = {key: m for key, m in zip(targets, made, strict=True) if m is not None}
        out: list[_Prepared | _Outcome | BaseException] = [_Outcome.STAYED] * len(moves)
        picked = []
        for i, (attempt, target, _) in enumerate(moves):
            if id(target) not in no_channel:
                picked.append(i)
            elif not stay_if_not_running:  # nothing was done to it: else it goes on there
                why = f"no channel to {target.worker_id}: {no_channel[id(target)]}"
                out[i] = self._recompute(attempt, source, why, reason)
        if not picked:
            return out
        try:
            detached = await source.client.detach([moves[i][0].req_id for i in picked])
        except WorkerDied as exc:
            for i in picked:
                why = f"{source.worker_id} died: {exc}"
                out[i] = self._recompute(moves[i][0], source, why, reason)
            return out
        except Exception as exc:  # noqa: BLE001 - they stay; the caller logs it
            for i in picked:
                out[i] = exc
            return out
        paused = time.perf_counter()
        # By target: (index, request id on the source, its input there, what detach gave).
        switched: dict[int, list[tuple[int, str, GenerationInput, DetachedRequest]]] = {}
        for i, request in zip(picked, detached, strict=True):
            attempt, target, new_id = moves[i]
            if self.attempts.get(attempt.req_id) is not attempt:  # it ended meanwhile
                self.spawn(self._abort(source, attempt.req_id))
                out[i] = _Outcome.ENDED
            elif request is None:  # queued, waiting for its KV, mid-recompute or finishing
                if not stay_if_not_running:
                    out[i] = self._recompute(attempt, source, "it was not running", reason)
            else:
                old_id = attempt.req_id
                inp = self._switch(attempt, target, request, new_id)
                switched.setdefault(id(target), []).append((i, old_id, inp, request))

        async def reserve(
            target: WorkerRef, group: list[tuple[int, str, GenerationInput, DetachedRequest]]
        ) -> None:
            try:
                held = await target.client.reserve_many(
                    [inp for _, _, inp, _ in group], self.config.lease_s, source.worker_id
                )
                why = f"no room on {target.worker_id}"
            except Exception as exc:  # noqa: BLE001 - then by recompute
                held, why = [None] * len(group), f"reserving on {target.worker_id} failed: {exc}"
            for (i, old_id, inp, request), reservation in zip(group, held, strict=True):
                attempt = moves[i][0]
                if reservation is None:
                    self.spawn(self._abort(source, old_id))
                    out[i] = self._recompute(attempt, source, why, reason)
                else:
                    move = DetachedMove(old_id, inp.req_id, request, reservation.num_precopied)
                    out[i] = _Prepared(attempt, target, move, paused)

        await asyncio.gather(*(reserve(targets[key], group) for key, group in switched.items()))
        return out

    async def _send(self, source: WorkerRef, group: list[_Prepared], reason: MoveReason) -> int:
        """Send one target's requests in one transfer; how many moved with their KV (on a
        failure none did: each continues by recompute)."""
        target = group[0].target
        moves = [p.move for p in group]
        try:
            num_bytes = await source.client.send_detached(
                HandoffTarget(target.worker_id, target.info.epoch), moves
            )
        except Exception as exc:  # noqa: BLE001 - then by recompute
            for p in group:
                self.spawn(self._abort(source, p.move.req_id))
                self._recompute(p.attempt, source, f"moving its KV failed: {exc}", reason)
            return 0
        sent_at = time.perf_counter()
        self.observer.migrated(source, f"{reason}_kv", len(group))
        for p in group:
            log.info(
                "request %s moved from %s to %s with its KV (%d tokens, %.1f ms paused; "
                "%d bytes for the %d requests sent together)",
                p.attempt.request_id,
                source.worker_id,
                target.worker_id,
                p.move.detached.num_kv_tokens,
                1e3 * (sent_at - p.paused),
                num_bytes,
                len(group),
            )
        return len(group)

    def _switch(
        self, attempt: Attempt, target: WorkerRef, detached: DetachedRequest, new_id: str
    ) -> GenerationInput:
        """The stream goes on as a new attempt on `target`, from the tokens detached: the
        request's KV covers all but the last of them, which the target continues from."""
        old = attempt.inp
        num_outputs = len(detached.token_ids) - len(old.prompt_token_ids)
        inp = replace(
            old,
            req_id=new_id,
            prompt_token_ids=detached.token_ids[: detached.num_kv_tokens],
            # The target counts the last token, already sampled, as its first output.
            sampling=replace(old.sampling, max_tokens=old.sampling.max_tokens - num_outputs + 1),
        )
        outputs = detached.token_ids[len(old.prompt_token_ids) :]
        # Late updates of the old id are dropped: the marker carries every token.
        self.attempts.pop(old.req_id, None)
        attempt.inbox.put(Moved(outputs, attempt.resumes_after))
        for lease in attempt.leases:
            lease.release()
        attempt.leases = [target.load.lease()]
        attempt.inp = inp
        attempt.decode_ref = target
        attempt.prefill_ref = None
        attempt.resumes_after += num_outputs
        self.attempts[inp.req_id] = attempt
        return inp

    def _recompute(
        self, attempt: Attempt, source: WorkerRef, why: str, reason: MoveReason
    ) -> _Outcome:
        """Fall back: the request continues elsewhere from its streamed tokens."""
        log.warning(
            "request %s leaves %s by recompute: %s", attempt.request_id, source.worker_id, why
        )
        attempt.inbox.put(
            WorkerLost(f"{source.worker_id} {reason}; {why}", worker=source, why=reason)
        )
        return _Outcome.RECOMPUTED

    async def _abort(self, ref: WorkerRef, req_id: str) -> None:
        with contextlib.suppress(WorkerDied):  # a dead worker's blocks went with it
            await ref.client.abort(req_id)
