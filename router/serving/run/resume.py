"""Resumed streams: a Generate call that names a request still decoding (its request id
and the completion tokens the client has) takes it over and streams the rest.

The request may have been placed by another router process of the tier, one that has
since died (its decode worker keeps it, decode_worker/outboxes.py), or by this one. The
serving core asks every decode (or colocated) worker where the request runs (`locate`,
by the client's request id), follows the attempt under its id (`Attempt` registered
first, so that no update of it finds no inbox), and asks that worker to hand it over
(`adopt`): every token it produced so far and, from the next step on, its updates in
this process's outbox. The client's tokens prime the detokenizer (stop strings
included), the ones it lacks are streamed first, then the request's own updates; a
later loss of its worker migrates it as any request (the prompt plus every token the
client has, the original seed). A call whose request is not found is NOT_FOUND, unless
the client has no token yet: then the request simply runs anew.

A call that carries `resume_from_tokens` (0 on its first try) is resumable: should its
client go away while the request decodes (a broken connection), the request is not
aborted but let go of (`let_go`): its decode worker keeps it for the grace, for the
resumed call to take over, and aborts it after.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from engine.core.outputs import PhaseTimings, TextChunk
from engine.core.request import FinishReason
from engine.wire import Handover, PoolName, TokenUpdate
from router.fleet.clients import WorkerDied
from router.serving.errors import ResumeNotFoundError
from router.serving.events import RequestObserver
from router.serving.interfaces import Renewals, Started, Streamer
from router.serving.protocol import GenerateCall
from router.serving.run.attempts import Attempt, ClientRequest, Progress, WorkerLost
from router.serving.run.in_flight import InFlight
from router.serving.run.worker_calls import WorkerCalls
from router.serving.workers import Pools, WorkerRef

log = logging.getLogger(__name__)

TOKEN_POOLS = (PoolName.DECODE, PoolName.COLOCATED)
# A request handed over just as its router process died may be between two states (its
# KV landing): how long to keep looking for it, and how often.
FIND_FOR_S = 3.0
FIND_EVERY_S = 0.05
# How long the tokens the client already has may take to arrive (a request handed
# over before its KV landed: its first token comes with the KV).
CATCH_UP_S = 30.0


@dataclass
class Resumed:
    """A request taken over: the attempt that continues it here, and its stream from
    the client's next token."""

    attempt: Attempt
    chunks: AsyncIterator[TextChunk]


class Resumer:
    """Takes requests over for resumed calls, and keeps a resumable call's request for
    the grace when its client goes away."""

    def __init__(
        self,
        pools: Pools,
        in_flight: InFlight,
        calls: WorkerCalls,
        renewals: Renewals,
        streamer: Streamer,
        observer: RequestObserver,
    ) -> None:
        self.pools = pools
        self.in_flight = in_flight
        self.calls = calls
        self.renewals = renewals
        self.streamer = streamer
        self.observer = observer

    async def take_over(self, call: GenerateCall, request: ClientRequest) -> Resumed | None:
        """The client's request, taken over with the client at `call.resume_from_tokens`
        tokens; None when it is nowhere and the client has no token (run it anew)."""
        have = call.resume_from_tokens or 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + FIND_FOR_S
        while True:
            found = await self._find(request)
            if found is not None:
                ref, attempt, handover = found
                return await self._continue(request, have, ref, attempt, handover)
            if not have:
                return None
            if loop.time() >= deadline:
                raise ResumeNotFoundError(
                    f"request {request.request_id} is not decoding any more (it ended, or its "
                    "router process went away longer ago than the grace): run it again"
                )
            await asyncio.sleep(FIND_EVERY_S)

    async def _find(self, request: ClientRequest) -> tuple[WorkerRef, Attempt, Handover] | None:
        refs = [w for w in self.pools.all() if w.pool in TOKEN_POOLS and w.state.serving]
        answers = await asyncio.gather(
            *(ref.client.locate(request.request_id) for ref in refs), return_exceptions=True
        )
        for ref, req_id in zip(refs, answers, strict=True):
            if not isinstance(req_id, str):
                continue
            # Followed before it is handed over: its first update here finds its inbox.
            inp = replace(request.base, req_id=req_id)
            attempt = Attempt(inp, request.request_id, decode_ref=ref)
            self.in_flight.by_id[req_id] = attempt
            self.observer.attempt_started(request, attempt)
            try:
                handover = await ref.client.adopt(req_id)
            except WorkerDied as exc:
                handover = None
                self.calls.died(ref, exc)
            if handover is not None:
                return ref, attempt, handover
            self.in_flight.end(attempt, abort=False)
        return None

    async def _continue(
        self,
        request: ClientRequest,
        have: int,
        ref: WorkerRef,
        attempt: Attempt,
        handover: Handover,
    ) -> Resumed:
        base, progress = request.base, request.progress
        inp = handover.inp
        num_prompt = len(base.prompt_token_ids)
        if inp.prompt_token_ids[:num_prompt] != base.prompt_token_ids:
            self.in_flight.end(attempt)
            raise ResumeNotFoundError(
                f"request {attempt.request_id} is decoding a different prompt: resume it "
                "with the request it was started with"
            )
        attempt.inp = inp
        earlier = inp.prompt_token_ids[num_prompt:]  # tokens of the attempts before this one
        attempt.resumes_after = len(earlier)
        attempt.leases.append(ref.load.lease())
        known = list(earlier) + list(handover.output_token_ids)
        reason = handover.finish_reason
        if handover.waiting_for_kv:
            self.renewals.hold(ref, inp.req_id)  # until its KV lands
        # Tokens the client has that came after the handover (its first, with its KV).
        while len(known) < have and reason is None:
            item = await attempt.inbox.take(CATCH_UP_S)
            if not isinstance(item, TokenUpdate):
                self.in_flight.end(attempt)
                raise ResumeNotFoundError(f"request {attempt.request_id} was lost: {item}")
            known += item.new_token_ids
            reason = item.finish_reason
        if have > len(known):
            self.in_flight.end(attempt)
            raise ResumeNotFoundError(
                f"request {attempt.request_id} has {len(known)} tokens, not {have}"
            )
        # The detokenizer (and its stop strings) where the client is.
        progress.output.process(tuple(known[:have]), None)
        progress.token_ids = known[:have]
        progress.num_resumed += 1
        progress.mark_decoding(PhaseTimings(queued_s=progress.since_arrival()))
        rest = tuple(known[have:])
        if reason is FinishReason.ERROR:
            # Its KV never landed there: the next attempt runs it from the client's tokens.
            attempt.inbox.put(WorkerLost(handover.error or "the decode worker failed it", True))
            reason = None
        log.info(
            "request %s resumed after %d tokens on %s (%d more known)",
            attempt.request_id,
            have,
            ref.worker_id,
            len(rest),
        )
        # Later attempts (a migration) keep the original seed.
        request.base = replace(base, sampling=replace(base.sampling, seed=inp.sampling.seed))
        chunks = self.streamer.stream(request, attempt, Started(rest, reason))
        return Resumed(attempt, chunks)

    def let_go(self, call: GenerateCall, attempt: Attempt, progress: Progress) -> bool:
        """A resumable call's client went away while its request decodes: hand the
        request to its decode worker's keeping instead of aborting it (True); False when
        the call is not resumable or the request is not decoding (abort it as any)."""
        ref = attempt.decode_ref
        if call.resume_from_tokens is None or ref is None or not progress.num_out:
            return False
        if not ref.state.serving:
            return False
        self.in_flight.end(attempt, abort=False)
        req_id = attempt.req_id

        async def keep() -> None:
            try:
                kept = await ref.client.let_go(req_id)
            except WorkerDied:
                return
            if not kept:  # no tier (one router process), or it ended meanwhile
                self.calls.abort(ref, req_id)
            else:
                log.info("request %s kept for a resumed stream", attempt.request_id)

        self.calls.spawn(keep())
        return True
