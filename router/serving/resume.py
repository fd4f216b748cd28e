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
from typing import TYPE_CHECKING

from engine.core.outputs import PhaseTimings, TextChunk
from engine.core.request import FinishReason
from engine.wire import GenerationInput, Handover, TokenUpdate
from router.fleet.clients import WorkerDied
from router.fleet.pools import WorkerRef
from router.serving.attempts import Attempt, Progress, WorkerLost
from router.serving.errors import ResumeNotFoundError
from router.serving.protocol import GenerateCall

if TYPE_CHECKING:
    from router.serving.orchestrator import DisaggregatedGenerator

log = logging.getLogger(__name__)

TOKEN_POOLS = ("decode", "colocated")
# A request handed over just as its router process died may be between two states (its
# KV landing): how long to keep looking for it, and how often.
FIND_FOR_S = 3.0
FIND_EVERY_S = 0.05
# How long the tokens the client already has may take to arrive (a request handed
# over before its KV landed: its first token comes with the KV).
CATCH_UP_S = 30.0


@dataclass
class Resumed:
    """A request taken over: its input as the new first attempt's base (the original
    seed), the attempt that continues it here, and its stream from the client's next
    token."""

    base: GenerationInput
    attempt: Attempt
    chunks: AsyncIterator[TextChunk]


async def take_over(
    core: DisaggregatedGenerator,
    call: GenerateCall,
    base: GenerationInput,
    progress: Progress,
    request_id: str,
) -> Resumed | None:
    """The request `request_id`, taken over with the client at `call.resume_from_tokens`
    tokens; None when it is nowhere and the client has no token (run it anew)."""
    have = call.resume_from_tokens or 0
    loop = asyncio.get_running_loop()
    deadline = loop.time() + FIND_FOR_S
    while True:
        found = await _find(core, base, request_id)
        if found is not None:
            ref, attempt, handover = found
            return await _continue(core, base, progress, have, ref, attempt, handover)
        if not have:
            return None
        if loop.time() >= deadline:
            raise ResumeNotFoundError(
                f"request {request_id} is not decoding any more (it ended, or its "
                "router process went away longer ago than the grace): run it again"
            )
        await asyncio.sleep(FIND_EVERY_S)


async def _find(
    core: DisaggregatedGenerator, base: GenerationInput, request_id: str
) -> tuple[WorkerRef, Attempt, Handover] | None:
    refs = [
        w
        for pool in TOKEN_POOLS
        for w in core.pools.workers[pool]
        if w.state in ("live", "draining")
    ]
    answers = await asyncio.gather(
        *(ref.client.locate(request_id) for ref in refs), return_exceptions=True
    )
    for ref, req_id in zip(refs, answers, strict=True):
        if not isinstance(req_id, str):
            continue
        # Followed before it is handed over: its first update here finds its inbox.
        attempt = Attempt(replace(base, req_id=req_id), request_id, decode_ref=ref)
        core._attempts[req_id] = attempt
        try:
            handover = await ref.client.adopt(req_id)
        except WorkerDied as exc:
            handover = None
            core.pools.mark_dead(ref, f"{ref.worker_id} died: {exc}")
        if handover is not None:
            return ref, attempt, handover
        core._attempts.pop(req_id, None)
    return None


async def _continue(
    core: DisaggregatedGenerator,
    base: GenerationInput,
    progress: Progress,
    have: int,
    ref: WorkerRef,
    attempt: Attempt,
    handover: Handover,
) -> Resumed:
    inp = handover.inp
    num_prompt = len(base.prompt_token_ids)
    if inp.prompt_token_ids[:num_prompt] != base.prompt_token_ids:
        core._end(attempt)
        raise ResumeNotFoundError(
            f"request {attempt.request_id} is decoding a different prompt: resume it with "
            "the request it was started with"
        )
    attempt.inp = inp
    earlier = inp.prompt_token_ids[num_prompt:]  # tokens of the attempts before this one
    attempt.resumes_after = len(earlier)
    attempt.leases.append(ref.load.lease())
    known = list(earlier) + list(handover.output_token_ids)
    reason = handover.finish_reason
    if handover.waiting_for_kv:
        core.leases.renewing[ref].add(inp.req_id)  # until its KV lands
    # Tokens the client has that came after the handover (its first, with its KV).
    while len(known) < have and reason is None:
        item = await attempt.inbox.take(CATCH_UP_S)
        if not isinstance(item, TokenUpdate):
            core._end(attempt)
            raise ResumeNotFoundError(f"request {attempt.request_id} was lost: {item}")
        known += item.new_token_ids
        reason = item.finish_reason
    if have > len(known):
        core._end(attempt)
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
    seeded = replace(base, sampling=replace(base.sampling, seed=inp.sampling.seed))
    return Resumed(seeded, attempt, core._stream(attempt, progress, rest, reason))


def let_go(
    core: DisaggregatedGenerator, call: GenerateCall, attempt: Attempt, progress: Progress
) -> bool:
    """A resumable call's client went away while its request decodes: hand the request
    to its decode worker's keeping instead of aborting it (True); False when the call is
    not resumable or the request is not decoding (abort it as any)."""
    ref = attempt.decode_ref
    if call.resume_from_tokens is None or ref is None or not progress.num_out:
        return False
    if ref.state not in ("live", "draining"):
        return False
    core._end(attempt, abort=False)
    req_id = attempt.req_id

    async def keep() -> None:
        try:
            kept = await ref.client.let_go(req_id)
        except WorkerDied:
            return
        if not kept:  # no tier (one router process), or it ended meanwhile
            await core._abort_on(ref, req_id)
        else:
            log.info("request %s kept for a resumed stream", attempt.request_id)

    core._spawn(keep())
    return True
