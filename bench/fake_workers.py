"""In-process fakes of the worker clients and the live pools, for the router's serving
core (its unit tests, and `bench.router_load`): a prefill worker that 'sends' KV to its
paired decode worker, decode workers that step every running request once per poll,
and controls to make them die, refuse or run out of room. A token is a function of the
seed and every token before it, prompt and outputs (as a real model's is of its context,
the sampler's randomness of the seed and position), so a request resumed elsewhere
produces the tokens of one left alone only when it continues from exactly the right
tokens. They report each request's phases as real workers do
(`PhaseReport`), and remember the trace context each request came with."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.core.request import FinishReason
from engine.wire import (
    ChannelSpec,
    DetachedMove,
    DetachedRequest,
    EngineSpeed,
    GenerationInput,
    HandoffTarget,
    Handover,
    KVEvents,
    KVLayout,
    PhaseReport,
    PoolName,
    Precopy,
    PrefillResult,
    Reservation,
    TokenBatch,
    TokenUpdate,
    WorkerInfo,
    WorkerStats,
)
from engine.worker.contract import WorkerCalls
from router.fleet.clients import KV_POLL_S, WorkerDied
from router.fleet.worker_ref import WorkerRef
from router.fleet.worker_state import WorkerState
from router.serving import workers

EPOCH = 5
NUM_BLOCKS = 1024


_DIGEST_MOD = (1 << 61) - 1  # a Mersenne prime: a context's digest mixes every token


def extend_digest(digest: int, token: int) -> int:
    """The digest of a context one token longer."""
    return (digest * 1_000_003 + token + 1) % _DIGEST_MOD


def context_digest(token_ids: Sequence[int]) -> int:
    """A digest of a whole context (prompt and outputs so far), in order."""
    digest = 0
    for token in token_ids:
        digest = extend_digest(digest, token)
    return digest


def token_after(seed: int, digest: int) -> int:
    """The token a fake samples after the context with this digest."""
    return (seed * 7 + digest * 13) % 1000 + 10


def tokens_after(context: Sequence[int], seed: int, num_tokens: int) -> list[int]:
    """The tokens a fake samples after `context`, one after the other."""
    digest = context_digest(context)
    tokens = []
    for _ in range(num_tokens):
        tokens.append(token_after(seed, digest))
        digest = extend_digest(digest, tokens[-1])
    return tokens


@dataclass
class _Running:
    inp: GenerationInput
    position: int  # of the next token
    remaining: int
    outputs: list[int]  # sampled so far (a hand-off's first token included)
    digest: int  # of the prompt and the outputs

    @classmethod
    def start(cls, inp: GenerationInput, first_token: int | None = None) -> _Running:
        outputs = [] if first_token is None else [first_token]
        n = len(inp.prompt_token_ids) + len(outputs)
        digest = context_digest(inp.prompt_token_ids + tuple(outputs))
        return cls(inp, n, inp.sampling.max_tokens - len(outputs), outputs, digest)

    def sample(self) -> int:
        """The next token; the request moves on by one."""
        token = token_after(self.inp.sampling.seed or 0, self.digest)
        self.digest = extend_digest(self.digest, token)
        self.outputs.append(token)
        self.position += 1
        self.remaining -= 1
        return token


@dataclass
class FakeWorker:
    """One worker; answers the verbs of its pool (the contract's every verb: checked by
    mypy below, as the workers themselves are)."""

    worker_id: str
    peers: dict[str, FakeWorker] = field(default_factory=dict)
    dead: bool = False
    no_room: bool = False  # decode: reserve() returns None
    refuse_kv: bool = False  # decode: every arriving hand-off is refused
    prefill_delay_s: float = 0.0
    kv_delay_s: float = 0.001  # prefill: from its reply to the KV landing on decode
    step_s: float = 0.002  # decode: one step of every running request per poll
    # decode: step by the clock instead, as a real engine runs between polls: a poll
    # returns every step due since the last one, one update per request (no hold or
    # death hooks). The router's speed then does not set the tokens' pace.
    steps_by_clock: bool = False
    last_poll: float | None = None
    hold_prefill: asyncio.Event | None = None  # prefill waits for it
    no_channel: bool = False  # decode: connect() to a peer fails
    # decode: dies right after a step that sampled the token at this position
    die_after_position: int | None = None
    # decode: stops stepping a request once it sampled the token at this position
    hold_after_position: int | None = None
    calls: list[tuple[str, Any]] = field(default_factory=list)
    reserved: dict[str, GenerationInput] = field(default_factory=dict)
    expires_at: dict[str, float] = field(default_factory=dict)  # decode: reservation leases
    running: dict[str, _Running] = field(default_factory=dict)
    detached: dict[str, DetachedRequest] = field(default_factory=dict)  # blocks kept
    # decode, as a move's target: blocks a pre-copy brought, by the move's new id; and
    # the blocks each move's final message skipped.
    precopied: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)
    aborted: set[str] = field(default_factory=set)
    outbox: list[TokenUpdate] = field(default_factory=list)
    trace_contexts: dict[str, dict[str, str]] = field(default_factory=dict)  # traced ones
    # Decode: requests whose first token (and phases) is still to come → ran their prompt
    # here (else their KV arrived).
    first_token_pending: dict[str, bool] = field(default_factory=dict)

    def _check(self) -> None:
        if self.dead:
            raise WorkerDied(f"{self.worker_id} is dead")

    def die(self) -> None:
        self.dead = True

    # ---------------------------------------------------------------- prefill verbs
    async def prefill(self, inp: GenerationInput, target: HandoffTarget) -> PrefillResult:
        self._check()
        self.calls.append(("prefill", inp.req_id))
        self._remember_context(inp)
        if self.hold_prefill is not None:
            await self.hold_prefill.wait()
        await asyncio.sleep(self.prefill_delay_s)
        self._check()
        if inp.req_id in self.aborted:
            return PrefillResult(None, FinishReason.ABORT, 0, 0.0)
        first = tokens_after(inp.prompt_token_ids, inp.sampling.seed or 0, 1)[0]
        phases = PhaseReport(queue_s=0.0, compute_s=self.prefill_delay_s)
        if inp.sampling.max_tokens == 1:
            return PrefillResult(first, FinishReason.LENGTH, 0, self.prefill_delay_s, phases=phases)
        decode = self.peers[target.worker_id]
        asyncio.get_running_loop().call_later(self.kv_delay_s, decode.receive_kv, inp.req_id, first)
        return PrefillResult(
            first, None, 0, self.prefill_delay_s, transfer_bytes=4096, phases=phases
        )

    # ---------------------------------------------------------------- live migration
    async def connect(self, spec: ChannelSpec) -> None:
        self._check()
        self.calls.append(("connect", spec.receiver_id))
        if self.no_channel:
            raise RuntimeError(f"{self.worker_id}: no channel can be made")

    async def disconnect(self, peer_id: str, notify_peer: bool) -> None:
        self._check()
        self.calls.append(("disconnect", peer_id))

    async def detach(self, req_ids: list[str]) -> list[DetachedRequest | None]:
        self._check()
        self.calls.append(("detach", ",".join(req_ids)))
        return [self._detach(req_id) for req_id in req_ids]

    def _detach(self, req_id: str) -> DetachedRequest | None:
        run = self.running.pop(req_id, None)
        if run is None:
            return None
        # As on a real worker, a token sampled just before the step boundary may not
        # have reached the router yet: the detached tokens are its only record.
        run.sample()
        detached = DetachedRequest(run.inp.prompt_token_ids + tuple(run.outputs), run.position - 1)
        self.detached[req_id] = detached
        return detached

    async def precopy(self, target: HandoffTarget, moves: list[Precopy]) -> dict[str, int]:
        """Each running request's full blocks (one a 16 tokens) go to the target."""
        self._check()
        self.calls.append(("precopy", ",".join(m.req_id for m in moves)))
        receiver = self.peers[target.worker_id]
        sent = {}
        for move in moves:
            run = self.running.get(move.req_id)
            if run is not None and run.position // 16:
                sent[move.as_req_id] = receiver.precopied[move.as_req_id] = run.position // 16
        return sent

    async def send_detached(self, target: HandoffTarget, moves: list[DetachedMove]) -> int:
        self._check()
        self.calls.append(("send_detached", ",".join(m.req_id for m in moves)))
        receiver = self.peers[target.worker_id]
        for move in moves:
            receiver.skipped[move.as_req_id] = move.skip_blocks
            self.detached.pop(move.req_id, None)
            asyncio.get_running_loop().call_later(
                self.kv_delay_s, receiver.receive_kv, move.as_req_id, move.detached.next_token
            )
        return 4096 * len(moves)

    # ---------------------------------------------------------------- decode verbs
    async def reserve(
        self, inp: GenerationInput, lease_s: float, source: str | None
    ) -> Reservation | None:
        self._check()
        self.calls.append(("reserve", inp.req_id))
        return self._reserve(inp, lease_s)

    def _reserve(self, inp: GenerationInput, lease_s: float) -> Reservation | None:
        self._remember_context(inp)
        if self.no_room or inp.req_id in self.aborted:
            return None
        self.reserved[inp.req_id] = inp
        self.expires_at[inp.req_id] = time.monotonic() + lease_s
        num_precopied = self.precopied.get(inp.req_id, 0)
        return Reservation(self.worker_id, EPOCH, tuple(range(num_precopied + 1)), num_precopied)

    async def reserve_many(
        self, inps: list[GenerationInput], lease_s: float, source: str | None
    ) -> list[Reservation | None]:
        self._check()
        self.calls.append(("reserve_many", ",".join(inp.req_id for inp in inps)))
        return [self._reserve(inp, lease_s) for inp in inps]

    async def renew(self, req_ids: list[str], lease_s: float) -> int:
        self._check()
        self.calls.append(("renew", tuple(req_ids)))
        held = [r for r in req_ids if r in self.reserved]
        for req_id in held:
            self.expires_at[req_id] = max(self.expires_at[req_id], time.monotonic() + lease_s)
        return len(held)

    def receive_kv(self, req_id: str, first_token: int) -> None:
        if self.dead:
            return
        inp = self.reserved.pop(req_id, None)
        self.precopied.pop(req_id, None)  # adopted, now complete
        expired = self.expires_at.pop(req_id, 0.0) < time.monotonic()
        if inp is None or self.refuse_kv or expired:
            if req_id not in self.aborted:
                error = "the reservation expired" if expired and inp else "refused"
                self.outbox.append(
                    TokenUpdate(req_id, finish_reason=FinishReason.ERROR, error=error)
                )
            return
        self.running[req_id] = _Running.start(inp, first_token)
        self.first_token_pending[req_id] = False
        arrival = PhaseReport(transfer_s=0.002, wire_bytes=4096, wire_s=0.001)
        self.outbox.append(TokenUpdate(req_id, kv_wire_s=0.001, kv_handoff_s=0.002, phases=arrival))

    async def submit(self, inp: GenerationInput) -> None:
        self._check()
        self.calls.append(("submit", inp.req_id))
        self._remember_context(inp)
        if inp.req_id in self.aborted:
            return
        self.first_token_pending[inp.req_id] = True
        self.running[inp.req_id] = _Running.start(inp)

    async def next_kv_events(self) -> tuple[KVEvents, ...]:
        """A fake holds no prefix cache: every poll ends empty, after its wait."""
        await asyncio.sleep(KV_POLL_S)
        self._check()
        return ()

    async def next_tokens(self) -> TokenBatch:
        await asyncio.sleep(self.step_s)
        self._check()
        updates, self.outbox = self.outbox, []
        if self.steps_by_clock:
            updates += self._steps_since_last_poll()
            return TokenBatch(tuple(updates), (), self._stats())
        for req_id, run in list(self.running.items()):
            if run.position - 1 == self.hold_after_position:
                continue
            token = run.sample()
            reason = FinishReason.LENGTH if run.remaining <= 0 else None
            phases = self._first_token_phases(req_id)
            updates.append(TokenUpdate(req_id, (token,), reason, phases=phases))
            if reason is not None:
                del self.running[req_id]
            if run.position - 1 == self.die_after_position:
                self.dead = True  # this batch still goes out; the next poll fails
        return TokenBatch(tuple(updates), (), self._stats())

    def _steps_since_last_poll(self) -> list[TokenUpdate]:
        now = time.monotonic()
        last, self.last_poll = self.last_poll, now
        steps = 1 if last is None else max(1, int((now - last) / self.step_s))
        updates = []
        for req_id, run in list(self.running.items()):
            tokens = tuple(run.sample() for _ in range(min(steps, run.remaining)))
            reason = FinishReason.LENGTH if run.remaining <= 0 else None
            phases = self._first_token_phases(req_id)
            updates.append(TokenUpdate(req_id, tokens, reason, phases=phases))
            if reason is not None:
                del self.running[req_id]
        return updates

    def _remember_context(self, inp: GenerationInput) -> None:
        if inp.trace_context:
            self.trace_contexts[inp.req_id] = inp.trace_context

    def _first_token_phases(self, req_id: str) -> PhaseReport | None:
        ran_prompt = self.first_token_pending.pop(req_id, None)
        if ran_prompt is None:
            return None
        if ran_prompt:
            return PhaseReport(queue_s=0.0, compute_s=self.step_s)
        return PhaseReport(admission_s=0.0, first_step_s=self.step_s)

    async def abort(self, req_id: str) -> None:
        self._check()
        self.calls.append(("abort", req_id))
        self.aborted.add(req_id)
        self.precopied.pop(req_id, None)
        self.detached.pop(req_id, None)
        self.reserved.pop(req_id, None)
        self.expires_at.pop(req_id, None)
        self.running.pop(req_id, None)
        self.first_token_pending.pop(req_id, None)

    async def load(self) -> WorkerStats:
        self._check()
        return self._stats()

    async def locate(self, request_id: str) -> str | None:
        return None  # a router tier's resumed streams are tested on real workers

    async def adopt(self, req_id: str) -> Handover | None:
        return None

    async def let_go(self, req_id: str) -> bool:
        return False  # not kept: the router aborts it

    def _stats(self) -> WorkerStats:
        pool, _, index = self.worker_id.partition("-")
        held = len(self.reserved) + len(self.running)
        return WorkerStats(PoolName(pool), int(index), NUM_BLOCKS, held, len(self.running), 0, 0, 0)

    @property
    def holds_nothing(self) -> bool:
        return not (self.reserved or self.running or self.detached or self.precopied)


# A fake of any worker kind: the router's calls (engine/worker/contract.py), checked by mypy.
_ANSWERS: type[WorkerCalls] = FakeWorker


class FakePools:
    """The pools as the serving core sees them (router.serving.workers.Pools), over fake
    workers."""

    def __init__(
        self,
        num_prefill: int,
        num_decode: int,
        num_colocated: int = 0,
        step_s: float = 0.002,
        steps_by_clock: bool = False,
        speed: EngineSpeed | None = None,
    ) -> None:
        sizes = {
            PoolName.PREFILL: num_prefill,
            PoolName.DECODE: num_decode,
            PoolName.COLOCATED: num_colocated,
        }
        self.targets: dict[str, int] = {pool: size for pool, size in sizes.items()}
        self.cluster = type("Cluster", (), {"use_gpus": False})()
        self.on_death: list[Callable[[workers.WorkerRef, str], None]] = []
        self.on_removed: list[Callable[[workers.WorkerRef], None]] = []
        self.on_live: list[Callable[[workers.WorkerRef], None]] = []
        self.drain_hooks: list[Callable[[workers.WorkerRef], Awaitable[None]]] = []
        self.fakes: dict[str, FakeWorker] = {}
        self.step_s, self.steps_by_clock = step_s, steps_by_clock
        self.speed = speed  # what each worker reports its warm-up measured (None: nothing)
        self.workers: dict[str, list[WorkerRef]] = {pool: [] for pool in sizes}
        self.num_restarts = 0  # replace() calls, as Pools counts its replacements
        for pool, size in sizes.items():
            for index in range(size):
                self.workers[pool].append(self._new_worker(pool, index, EPOCH))
        decode_ids = [w.worker_id for w in self.workers[PoolName.DECODE]]
        for ref in self.workers[PoolName.PREFILL] + self.workers[PoolName.DECODE]:
            if ref.pool is PoolName.PREFILL:
                ref.peers.update(decode_ids)
            self.fakes[ref.worker_id].peers = {d: self.fakes[d] for d in decode_ids}

    def _new_worker(self, pool: PoolName, index: int, epoch: int) -> WorkerRef:
        worker_id = f"{pool}-{index}"
        fake = FakeWorker(worker_id, step_s=self.step_s, steps_by_clock=self.steps_by_clock)
        self.fakes[worker_id] = fake
        layout = KVLayout("fake", "float32", 16, 2, 2, 8)
        info = WorkerInfo(
            worker_id, pool, index, epoch, layout, NUM_BLOCKS, 4096, 2000, "fake", "cpu", 0,
            "127.0.0.1", speed=self.speed,
        )  # fmt: skip
        return WorkerRef(pool, index, None, info, client_impl=fake)

    def replace(self, worker_id: str) -> WorkerRef:
        """As router.fleet.pools.Pools does for a dead worker: a new incarnation with the same id
        and a new epoch, paired with the other pool, live, announced to the hooks."""
        old = next(w for w in self.all() if w.worker_id == worker_id)
        self.workers[old.pool].remove(old)
        for callback in self.on_removed:
            callback(old)
        ref = self._new_worker(old.pool, old.index, old.info.epoch + 1)
        self.num_restarts += 1
        self.workers[old.pool].append(ref)
        if ref.pool is PoolName.DECODE:
            fake = self.fakes[worker_id]
            fake.peers = {
                d.worker_id: self.fakes[d.worker_id] for d in self.workers[PoolName.DECODE]
            }
            for other in self.fakes.values():
                if worker_id in other.peers:
                    other.peers[worker_id] = fake
            for prefill in self.workers[PoolName.PREFILL]:
                prefill.peers.add(worker_id)
                ref.peers.add(prefill.worker_id)
        self.announce_live(worker_id)
        return ref

    def routable(self, pool: PoolName) -> list[WorkerRef]:
        return [w for w in self.workers[pool] if w.alive]

    def all(self) -> list[WorkerRef]:
        return [w for refs in self.workers.values() for w in refs]

    def find(self, worker_id: str) -> WorkerRef | None:
        return next((w for w in self.all() if w.worker_id == worker_id), None)

    @property
    def reference(self) -> WorkerInfo | None:
        return self.all()[0].info

    async def link_peers(self, sender: workers.WorkerRef, receiver: workers.WorkerRef) -> None:
        spec = ChannelSpec("127.0.0.1", 0, sender.worker_id, EPOCH, receiver.worker_id, EPOCH)
        await asyncio.gather(sender.client.connect(spec), receiver.client.connect(spec))

    async def unlink_peers(self, peer: workers.WorkerRef, gone_id: str) -> None:
        with contextlib.suppress(WorkerDied):
            await peer.client.disconnect(gone_id, False)

    def announce_live(self, worker_id: str) -> None:
        """As router.fleet.pools.Pools does once a worker is live and paired: the hooks."""
        ref = next(w for w in self.all() if w.worker_id == worker_id)
        for callback in self.on_live:
            callback(ref)

    async def drain(self, worker_id: str) -> None:
        """As router.fleet.pools.Pools.drain: no new work, the hooks, then wait until empty."""
        ref = next(w for w in self.all() if w.worker_id == worker_id)
        ref.state = WorkerState.DRAINING
        for hook in self.drain_hooks:
            await hook(ref)
        while ref.num_assigned:
            await asyncio.sleep(0.001)
        ref.state = WorkerState.GONE
        for callback in self.on_removed:
            callback(ref)

    async def scale(self, pool: str, size: int) -> None:
        """Not faked: these pools keep the sizes they were made with. Scaling is tested on
        router.fleet.pools.Pools over a fake cluster (tests/test_pools.py)."""
        raise NotImplementedError("FakePools has fixed pool sizes")

    def mark_dead(self, ref: workers.WorkerRef, reason: str) -> None:
        assert isinstance(ref, WorkerRef)  # one of these pools' own
        if ref.state is WorkerState.DEAD:
            return
        ref.state = WorkerState.DEAD
        for callback in self.on_death:
            callback(ref, reason)
