"""A decode worker's token updates, one outbox per consumer (router process).

A service with one router process reads every update through one long poll, the
unnamed consumer "". With a router tier (several router processes,
docs/architecture.md), each request belongs to the process that placed it: its input
names that process (`GenerationInput.consumer`), and the worker puts the request's
updates in that consumer's outbox, which only its `next_tokens(consumer=...)` takes.
With no named consumer the routing costs nothing: every update goes to "" as before.

A consumer that has no poll in flight for `LOST_AFTER_S` has gone away (its process
died). Its requests become *orphans*: their tokens so far are read off the engine at a
step boundary, and every later update is added to that record, so that another router
process can take a request over (`adopt`, a resumed stream) with every token it
produced. After the consumer's grace (`grace_s`, given with its polls) the worker aborts
what is left of its requests and frees their blocks. A consumer that polls again in
time takes its outbox back as it was.

This class is the event loop's side; the engine-thread reads are the worker's
(decode_worker/worker.py). Every change of a request's consumer is made on the event
loop in order with the steps' updates (a callback the engine thread queues right behind
the updates it has posted), so no update is lost or delivered twice across the switch.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from engine.core.request import FinishReason
from engine.wire import GenerationInput, Handover, TokenUpdate

# A named consumer with no poll in flight for this long is gone. Its polls return at
# least once a second (their wait), so this is several missed polls.
LOST_AFTER_S = 5.0
# How long a gone consumer's requests are kept for another consumer to take over,
# unless its polls say otherwise.
DEFAULT_GRACE_S = 30.0


@dataclass(eq=False)
class _Box:
    updates: list[TokenUpdate] = field(default_factory=list)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    num_polling: int = 0
    last_seen: float = 0.0
    lost_since: float | None = None  # its last sign of life, once it is deemed gone
    grace_s: float = DEFAULT_GRACE_S


@dataclass
class Orphan:
    """A request whose consumer went away (or let it go): every token it produced, and
    its end. `until`: when a request let go of is given up (a gone consumer's requests
    go with its grace)."""

    outputs: list[int]
    finish_reason: FinishReason | None = None
    error: str = ""
    until: float | None = None


class Outboxes:
    """Per consumer, the updates of its requests not yet taken (event loop only)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._default = _Box()
        self._boxes: dict[str, _Box] = {}  # the named consumers
        self._default_polled = False
        # Requests of named consumers: their input (the consumer is on it), and by the
        # client's request id.
        self._inputs: dict[str, GenerationInput] = {}
        self._by_request_id: dict[str, str] = {}
        self._orphans: dict[str, Orphan] = {}
        # Requests handed over before their KV landed: their first token is posted as an
        # update when it does (the prefill reply that carried it went to the old consumer).
        self._awaiting_first: set[str] = set()

    # ---------------------------------------------------------------- consumers
    def box(self, consumer: str) -> _Box:
        if not consumer:
            return self._default
        box = self._boxes.get(consumer)
        if box is None:
            box = self._boxes[consumer] = _Box(last_seen=self._clock())
        return box

    @property
    def consumers(self) -> frozenset[str]:
        return frozenset(self._boxes)

    def poll_started(self, consumer: str, grace_s: float | None) -> _Box:
        box = self.box(consumer)
        if not consumer:
            self._default_polled = True
            return box
        box.num_polling += 1
        box.last_seen = self._clock()
        if grace_s is not None:
            box.grace_s = grace_s
        if box.lost_since is not None:  # not gone after all: its outbox has everything
            box.lost_since = None
            for req_id, inp in self._inputs.items():
                if inp.consumer == consumer:
                    self._orphans.pop(req_id, None)
                    self._awaiting_first.discard(req_id)
        return box

    def poll_ended(self, box: _Box) -> None:
        if box is not self._default:
            box.num_polling -= 1
            box.last_seen = self._clock()

    def take(self, box: _Box) -> list[TokenUpdate]:
        out, box.updates = box.updates, []
        return out

    # ---------------------------------------------------------------- requests
    def assign(self, inp: GenerationInput) -> None:
        """A request arrived here (reserved or submitted) for `inp.consumer`."""
        if not inp.consumer:
            return
        self.box(inp.consumer)
        self._inputs[inp.req_id] = inp
        if inp.request_id:
            self._by_request_id[inp.request_id] = inp.req_id

    def forget(self, req_id: str) -> None:
        """The request ended here without an update saying so (aborted, moved away)."""
        inp = self._inputs.pop(req_id, None)
        if inp is not None and self._by_request_id.get(inp.request_id) == req_id:
            del self._by_request_id[inp.request_id]
        self._orphans.pop(req_id, None)
        self._awaiting_first.discard(req_id)

    def consumer_of(self, req_id: str) -> str | None:
        inp = self._inputs.get(req_id)
        return None if inp is None else inp.consumer

    def locate(self, request_id: str) -> str | None:
        """The attempt id of the client's request, while this worker has it."""
        return self._by_request_id.get(request_id)

    def holds_kv_pending(self, req_id: str) -> bool:
        return req_id in self._awaiting_first

    # ---------------------------------------------------------------- routing
    def route(self, updates: list[TokenUpdate]) -> None:
        """Each update into its request's consumer's outbox (an orphan's into its record)."""
        default = self._default
        if not self._boxes:  # one router process: every update is its
            default.updates.extend(updates)
            default.ready.set()
            return
        inputs, orphans = self._inputs, self._orphans
        woken: set[_Box] = set()
        for u in updates:
            inp = inputs.get(u[0])
            if inp is None:
                if self._default_polled:
                    default.updates.append(u)
                    woken.add(default)
                continue  # a request nobody reads any more (aborted)
            orphan = orphans.get(u[0])
            if orphan is not None:
                orphan.outputs.extend(u[1])
                if u[2] is not None:
                    orphan.finish_reason, orphan.error = u[2], u.error
                if orphan.until is not None:
                    continue  # let go of: its consumer no longer reads it
            elif u[2] is not None:
                self.forget(u[0])
            box = self._boxes.get(inp.consumer)
            if box is not None:
                box.updates.append(u)
                woken.add(box)
        for box in woken:
            box.ready.set()

    def first_token(self, req_id: str, token: int) -> None:
        """The first token of a request handed over (or orphaned) before its KV landed."""
        if req_id not in self._awaiting_first:
            return
        self._awaiting_first.discard(req_id)
        orphan = self._orphans.get(req_id)
        if orphan is not None:
            orphan.outputs.insert(0, token)
        else:
            self.route([TokenUpdate(req_id, (token,))])

    # ---------------------------------------------------------------- gone consumers
    def sweep(self) -> tuple[list[str], list[str]]:
        """Consumers deemed gone just now (their requests: `start_orphans`), and the
        requests whose consumer's grace is over (to abort)."""
        now = self._clock()
        lost: list[str] = []
        expired: list[str] = []
        for req_id, orphan in list(self._orphans.items()):
            if orphan.until is not None and now > orphan.until:
                self.forget(req_id)
                expired.append(req_id)
        for consumer, box in list(self._boxes.items()):
            if box.lost_since is None:
                if box.num_polling == 0 and now - box.last_seen > LOST_AFTER_S:
                    box.lost_since = box.last_seen
                    lost.append(consumer)
            elif now - box.lost_since > box.grace_s:
                mine = [r for r, inp in self._inputs.items() if inp.consumer == consumer]
                for req_id in mine:
                    self.forget(req_id)
                expired.extend(mine)
                del self._boxes[consumer]
        return lost, expired

    def requests_of(self, consumer: str) -> list[str]:
        return [r for r, inp in self._inputs.items() if inp.consumer == consumer]

    def start_orphans(
        self, outputs: dict[str, tuple[int, ...] | None], keep_s: float | None = None
    ) -> None:
        """Records for a gone consumer's requests, from their tokens read at a step
        boundary (None: not on the engine yet, its KV still to land). Called in order
        with the steps' updates: each later update adds to the record. `keep_s`: the
        requests were let go of by a consumer that is still there (`let_go`), and are
        given up after that long."""
        until = None if keep_s is None else self._clock() + keep_s
        for req_id, tokens in outputs.items():
            inp = self._inputs.get(req_id)
            if inp is None or req_id in self._orphans:
                continue  # ended meanwhile
            box = self._boxes.get(inp.consumer)
            if until is None and (box is None or box.lost_since is None):
                continue  # back meanwhile
            self._orphans[req_id] = Orphan(list(tokens or ()), until=until)
            if tokens is None:
                self._awaiting_first.add(req_id)

    # ---------------------------------------------------------------- handing over
    def handover_now(self, req_id: str, consumer: str) -> Handover | None:
        """The request, taken over by `consumer`, when its record says everything (an
        orphan); None when the engine must be read first (`handover_at_boundary`)."""
        orphan = self._orphans.get(req_id)
        inp = self._inputs.get(req_id)
        if orphan is None or inp is None or req_id in self._awaiting_first:
            return None
        handover = Handover(
            replace(inp, consumer=consumer),
            tuple(orphan.outputs),
            orphan.finish_reason,
            orphan.error,
        )
        if orphan.finish_reason is not None:
            self._drop_pending(req_id, inp.consumer)
            self.forget(req_id)
        else:
            self._switch(req_id, consumer)
        return handover

    def handover_at_boundary(
        self, req_id: str, consumer: str, outputs: tuple[int, ...] | None, kv_pending: bool
    ) -> Handover | None:
        """The request, taken over by `consumer`, from its tokens read at a step boundary
        (None: not on the engine; `kv_pending`: its reservation is held). Called in
        order with the steps' updates, right after those the tokens cover."""
        inp = self._inputs.get(req_id)
        if inp is None:
            return None  # ended meanwhile
        if outputs is None:
            if not kv_pending:
                return None
            self._awaiting_first.add(req_id)
            self._switch(req_id, consumer)
            return Handover(replace(inp, consumer=consumer), (), waiting_for_kv=True)
        self._switch(req_id, consumer)
        return Handover(replace(inp, consumer=consumer), outputs)

    def _switch(self, req_id: str, consumer: str) -> None:
        inp = self._inputs[req_id]
        self._drop_pending(req_id, inp.consumer)
        self._orphans.pop(req_id, None)
        self.box(consumer)
        self._inputs[req_id] = replace(inp, consumer=consumer)

    def _drop_pending(self, req_id: str, consumer: str) -> None:
        """The old consumer's updates of a request handed over: they are in the handover."""
        box = self._boxes.get(consumer)
        if box is not None and box.updates:
            box.updates = [u for u in box.updates if u[0] != req_id]
